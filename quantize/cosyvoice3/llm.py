"""Fun-CosyVoice3 LLM stage (`CosyVoice3LM`): the CosyVoice2 Qwen2 LM with a wider speech vocabulary.

Same Qwen2 body, KV-cache prefill/decode and greedy rule as CosyVoice2 (`cosyvoice2.llm.Qwen2LM`, reused through
its family hooks); what differs, and why it lives here:

* no `llm_embedding`: sos = speech_token_size (6561), task_id = +2 (6563) are rows of `speech_embedding`;
  eos = +1 (6562), fill = +3;
* `speech_embedding` / `llm_decoder` have speech_token_size + S rows (S = 200 officially), the decoder no bias;
  S is read from `llm.pt` (the yaml does not state it), so a release with another S still loads strictly;
* the stop set is every id in [speech_token_size, speech_token_size + S);
* the official min_len guard still masks `speech_token_size`, which is sos in v3: eos and the other stop ids stay
  allowed before min_len (the quirk is reproduced, `LLMConfig.min_len_masked_id`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.llm import GreedyResult, LLMConfig, Qwen2LM, greedy_choice, load_llm_state
from cosyedge.quantize.cosyvoice3.release import YAML_NAME, Release3

CHECKPOINT_NAME = "llm.pt"
COSYVOICE3LM_TARGET = "cosyvoice.llm.llm.CosyVoice3LM"
OFFICIAL_EXTRA_IDS = 200       # hard-coded in the official class: speech_token_size + 200 rows
MIN_EXTRA_IDS = 4              # sos, eos, task_id, fill

__all__ = ["CosyVoice3LM", "LLM3Config", "GreedyResult", "build_llm", "build_llm_random", "greedy_choice"]


@dataclass(frozen=True)
class LLM3Config(LLMConfig):
    """CosyVoice3LM: `extra_ids` special rows after the speech codes (sos, eos, task_id, fill, ... stop ids)."""
    extra_ids: int = OFFICIAL_EXTRA_IDS
    target: ClassVar[str] = COSYVOICE3LM_TARGET
    yaml_name: ClassVar[str] = YAML_NAME
    decoder_bias: ClassVar[bool] = False

    @property
    def speech_vocab(self) -> int:
        return self.speech_token_size + self.extra_ids

    @property
    def sos(self) -> int:
        return self.speech_token_size

    @property
    def eos(self) -> int:
        return self.speech_token_size + 1

    @property
    def task_id(self) -> int:
        return self.speech_token_size + 2

    @property
    def fill(self) -> int:
        return self.speech_token_size + 3

    @property
    def sos_task_ids(self) -> tuple[int, int]:  # type: ignore[override]  # instance value instead of None
        return (self.sos, self.task_id)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(range(self.speech_token_size, self.speech_vocab))

    def is_stop(self, token: int) -> bool:
        return self.speech_token_size <= token < self.speech_vocab


class CosyVoice3LM(Qwen2LM):
    """The v3 text-speech LM; keys `llm.model.*`, `speech_embedding.weight`, `llm_decoder.weight`."""

    config: LLM3Config

    def __init__(self, config: LLM3Config) -> None:
        super().__init__(config)


def _extra_ids(state: dict[str, torch.Tensor], speech_token_size: int) -> int:
    rows = state.get("speech_embedding.weight")
    if rows is None or rows.dim() != 2:
        raise ReleaseError(f"{CHECKPOINT_NAME}: missing key 'speech_embedding.weight'")
    extra = int(rows.shape[0]) - speech_token_size
    if extra < MIN_EXTRA_IDS:
        raise ReleaseError(f"{CHECKPOINT_NAME}: key 'speech_embedding.weight' has {rows.shape[0]} rows, expected "
                           f"speech_token_size {speech_token_size} + at least {MIN_EXTRA_IDS} special ids")
    return extra


def build_llm_random(hparams: dict[str, Any], qwen_config: dict[str, Any],
                     extra_ids: int = OFFICIAL_EXTRA_IDS) -> CosyVoice3LM:
    """The module from hyper-parameters alone, random weights (for random-weight full-size releases)."""
    return CosyVoice3LM(LLM3Config.from_release(hparams, qwen_config, extra_ids=extra_ids)).eval()


def build_llm(release: Release3) -> CosyVoice3LM:
    """The module with the release's `llm.pt` (float16 or float32 on disk, float32 here), strict keys and shapes."""
    state = release.checkpoint(CHECKPOINT_NAME)
    speech_token_size = int(release.hparams["llm"]["speech_token_size"])
    module = build_llm_random(release.hparams, release.qwen_config, _extra_ids(state, speech_token_size))
    load_llm_state(module, state, CHECKPOINT_NAME)
    return module
