"""Load a whole Fun-CosyVoice3 release into the three torch reference modules, every checkpoint strictly checked.

Separate from release.py because the stage modules import the release reader (no import cycle), and the first
broken file or key stops the load with a ReleaseError naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cosyedge.quantize.cosyvoice3.flow import CausalMaskedDiffWithDiT, build_flow
from cosyedge.quantize.cosyvoice3.hift import CausalHiFTGenerator, build_hift
from cosyedge.quantize.cosyvoice3.llm import CosyVoice3LM, build_llm
from cosyedge.quantize.cosyvoice3.release import Release3, open_release


@dataclass(frozen=True)
class Models:
    release: Release3
    llm: CosyVoice3LM
    flow: CausalMaskedDiffWithDiT
    hift: CausalHiFTGenerator


def load_models(root: Path | str) -> Models:
    release = open_release(root)
    return Models(release, build_llm(release), build_flow(release), build_hift(release))
