"""Read an official Fun-CosyVoice3 release directory (yaml, checkpoints) without the official code.

The directory layout and the yaml dialect are CosyVoice2's, so this reuses the CosyVoice2 reader
(`cosyvoice2.release`: HyperPyYAML parsing, float16/float32 upcast, both weight-norm key styles, strict
key/shape checks) and changes only what differs: the yaml name, the v3 speech tokenizer, and the HiFT
f0 predictor, whose weight norm must be folded in float64 (the official code runs it in float64 and its
f0 tolerance, 1e-6 Hz, is missed by a float32 fold). Every size comes from the files; nothing here knows
the widths of the real model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.release import Release, fold_weight_norm, load_checkpoint

YAML_NAME = "cosyvoice3.yaml"
REQUIRED_FILES = (YAML_NAME, "llm.pt", "flow.pt", "hift.pt", "campplus.onnx",
                  "speech_tokenizer_v3.onnx", "CosyVoice-BlankEN/config.json",
                  "CosyVoice-BlankEN/vocab.json", "CosyVoice-BlankEN/merges.txt")
SPK2INFO_NAME = "spk2info.pt"
F0_PREFIX = "f0_predictor."


class Release3(Release):
    """An official Fun-CosyVoice3 release directory, validated: files present, yaml and Qwen2 config parsed."""
    yaml_name: ClassVar[str] = YAML_NAME
    required_files: ClassVar[tuple[str, ...]] = REQUIRED_FILES

    def raw_checkpoint(self, name: str) -> dict[str, torch.Tensor]:
        """The state dict as stored (floats upcast to float32, `generator.` stripped), weight norm NOT folded."""
        state = load_checkpoint(self.root / name)
        return {k.removeprefix("generator."): v for k, v in state.items()}

    def hift_checkpoint(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """`hift.pt` split into (generator state folded in float32, f0 predictor state folded in float64).

        The f0 predictor keys keep their names without the `f0_predictor.` prefix."""
        state = self.raw_checkpoint("hift.pt")
        f0 = {k[len(F0_PREFIX):]: v.double() for k, v in state.items() if k.startswith(F0_PREFIX)}
        rest = {k: v for k, v in state.items() if not k.startswith(F0_PREFIX)}
        return fold_weight_norm(rest), fold_weight_norm(f0)

    def spk2info(self) -> dict[str, dict[str, np.ndarray]]:
        """The optional saved speakers (`spk2info.pt`): speaker id -> field -> array; {} when absent."""
        path = self.root / SPK2INFO_NAME
        if not path.is_file():
            return {}
        try:
            raw: Any = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means a broken file
            raise ReleaseError(f"{SPK2INFO_NAME}: cannot be read as a torch file ({type(exc).__name__})") from None
        if not isinstance(raw, dict):
            raise ReleaseError(f"{SPK2INFO_NAME}: expected a dict of speakers, found {type(raw).__name__}")
        out: dict[str, dict[str, np.ndarray]] = {}
        for spk, fields in raw.items():
            if not isinstance(fields, dict):
                raise ReleaseError(f"{SPK2INFO_NAME}: speaker {spk!r} is not a dict of tensors")
            out[str(spk)] = {str(k): (v.float() if v.is_floating_point() else v).numpy()
                             for k, v in fields.items() if isinstance(v, torch.Tensor)}
        return out


def open_release(root: Path | str) -> Release3:
    """Validate and open a Fun-CosyVoice3 release (files, yaml, Qwen2 config)."""
    return Release3.open(root)
