"""The preset gate's failure path, one helper for both CosyVoice families (tests/device/test_cv2_presets.py,
tests/device/test_cv3_presets.py): a crude candidate (one Euler step, no guidance, no streaming window) measured on
the bundle's own fp32 graphs must fail `preset_report.judge_preset` and must not be offered, while `official`
(the reference) is. With `judge_preset` accepting everything the crude preset is offered and the check fails.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.presets import OFFICIAL, Preset
from cosyedge.quantize.cosyvoice2.gates import session
from cosyedge.quantize.cosyvoice2.preset_report import bundle_presets, zero_shot_prompt

FLOW_GRAPHS = ("flow_encoder", "flow_estimator", "hift_source", "hift_decoder")


def assert_a_failing_preset_is_not_offered(bundle_root: Path, vocoder_part: Callable) -> None:
    bundle = Bundle.load(bundle_root)
    graphs = {name: bundle.path(bundle.component(name, "fp32").file) for name in FLOW_GRAPHS}
    steps = int(bundle.manifest.config["n_timesteps"])
    candidates = {OFFICIAL: Preset(OFFICIAL, steps, steps), "crude": Preset("crude", 1, 0, 0)}
    voices = [bundle.asset(f"voice:{name}") for name in bundle.manifest.voices]
    offered, quality = bundle_presets({"fp32": graphs}, np.load(bundle.asset("cfm_noise")), bundle.manifest.config,
                                      zero_shot_prompt(voices), session, vocoder_part=vocoder_part,
                                      candidates=candidates)
    crude = quality["fp32"]["crude"]
    assert not crude["passed"] and crude["failures"], crude["metrics"]
    assert quality["fp32"][OFFICIAL]["passed"]
    assert list(offered) == [OFFICIAL]
