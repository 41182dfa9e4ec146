"""Both CosyVoice families are one pipeline built from parts (device/cosyvoice2/parts.py): each family's parts
satisfy every part protocol, so a method added to a part for one family and not given by the other fails here
(and under a type checker), and the pipeline a bundle loads is the same class for both families."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.frontend import TextFrontend
from cosyedge.device.cosyvoice2.llm import DecodeConfig
from cosyedge.device.cosyvoice2.parts import FamilyParts, Vocoder
from cosyedge.device.cosyvoice2.pipeline import CosyVoicePipeline
from cosyedge.device.cosyvoice2.streaming import ChunkVocoder, ScheduleConfig, TokenFilter
from cosyedge.device.families import load_pipeline
from cosyedge.device.sessions import SessionConfig


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def pipeline(request: pytest.FixtureRequest) -> CosyVoicePipeline:
    bundle = request.getfixturevalue(f"{'cv2' if request.param == 'cosyvoice2' else 'cv3'}_tiny_bundle")
    return load_pipeline(Bundle.load(bundle), "fp32", SessionConfig(providers=("cpu",), intra_op_threads=1))


def test_both_families_are_the_one_pipeline_with_their_parts(pipeline: CosyVoicePipeline) -> None:
    parts = pipeline._parts
    assert type(pipeline) is CosyVoicePipeline and isinstance(parts, FamilyParts)
    assert pipeline.describe()["family"] == parts.family
    assert isinstance(parts.frontend, TextFrontend) and isinstance(parts.decode, DecodeConfig)
    assert isinstance(parts.schedule, ScheduleConfig)
    assert isinstance(parts.vocoder, Vocoder) and isinstance(parts.vocoder.stream(None), ChunkVocoder)
    first, second = parts.token_filter(), parts.token_filter()
    assert isinstance(first, TokenFilter) and first is not second   # per utterance, never shared
    assert set(parts.modes) <= {"zero_shot", "sft", "cross_lingual", "instruct2"} and "zero_shot" in parts.modes


def test_every_part_field_is_given_by_each_family(pipeline: CosyVoicePipeline) -> None:
    """No part left to a default by accident: the fields without defaults are the ones both families must give."""
    required = {f.name for f in dataclasses.fields(FamilyParts) if f.default is dataclasses.MISSING}
    assert required == {"family", "frontend", "decode", "vocoder", "schedule", "token_filter", "modes"}
    assert all(getattr(pipeline._parts, name) is not None for name in required)


def test_the_families_differ_only_in_their_parts(cv3_tiny_bundle: Path) -> None:
    v3 = load_pipeline(Bundle.load(cv3_tiny_bundle), "fp32", SessionConfig(providers=("cpu",), intra_op_threads=1))
    parts = v3._parts
    assert parts.family == "cosyvoice3" and parts.decode.eos == 6561 and parts.min_prompt_seconds == 3.0
    assert parts.saved_speaker_quirk and "sft" not in parts.modes
    silent = parts.token_filter()
    assert [silent.keep(1) for _ in range(7)] == [True] * 5 + [False] * 2   # runs of silence cut after 5
