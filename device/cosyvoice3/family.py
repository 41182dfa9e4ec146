"""Fun-CosyVoice3's parts of the shared CosyVoice pipeline (`cosyvoice2.parts.FamilyParts`), and its factory.

Everything else is the one CosyVoice pipeline (`cosyvoice2.pipeline.CosyVoicePipeline`: the LLM session wrapper with
its KV cache, the cross-request decode scheduler, RAS / greedy sampling, the flow's Euler solver with the fixed CFM
noise and its quality presets, the stream loop with the bounded re-solve and the chunk gate, voices and prompt
features, batching). The v3 parts:

* text: the v3 tokenizer (`frontend.TextFrontend3`) and the `<|endofprompt|>` rule (InputError when neither the LLM
  prompt text nor the segment carries it); an instruction without it (the API's `instructions`, "speak
  cheerfully") gets the official frame "You are a helpful assistant. <instruction><|endofprompt|>"; a registered
  voice's transcript without it gets the system prompt before it;
* LLM: sos / task_id are rows of speech_embedding (the bundle stores them as CosyVoice2's [2, H] table); decoding
  stops on any id of the 200-id stop set; the min_len guard masks `min_len_masked_id` (6561 = sos: the official
  quirk, so eos is NOT blocked before min_len);
* token filter: the silent filter between LLM and flow (`frontend.SilentFilter`): the LLM conditions on every token;
* vocoder: the causal HiFT with the fixed sine noise (`vocoder.Vocoder3`), deterministic whatever the request;
  streaming re-runs HiFT on the accumulated mel and emits only new samples (`vocoder.RerunStream`);
* instruct2 with a bundle voice (an official saved speaker, spk2info): the official frontend replaces the
  instruction by the speaker's prompt text. Reproduced by default (`instruct2_saved_speaker_quirk` in the
  manifest); `CosyVoicePipeline.instruct2_uses_instruction = True` gives the intended behaviour. Voices registered
  at run time behave like the official prompt-wav path (the instruction is used);
* voice registration: 3-30 s of prompt audio (shorter prompts are refused: the official examples use 3-10 s and
  the zero-shot LLM continues the prompt's speech tokens, which a 1-2 s prompt barely gives it).
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.llm import DecodeConfig
from cosyedge.device.cosyvoice2.parts import FamilyParts
from cosyedge.device.cosyvoice2.pipeline import CosyVoicePipeline
from cosyedge.device.cosyvoice2.streaming import ScheduleConfig
from cosyedge.device.cosyvoice3.frontend import MODES, SilentFilter, TextFrontend3
from cosyedge.device.cosyvoice3.vocoder import SineNoise, Vocoder3
from cosyedge.device.sessions import SessionConfig

MIN_PROMPT_SECONDS = 3.0   # the global registration limits (voice_store) are 1-30 s


def vocoder(config: dict[str, Any], hift: tuple[Any, Any], sample_rate: int) -> Vocoder3:
    """The causal HiFT part from the manifest config and the (`hift_source`, `hift_decoder`) sessions."""
    return Vocoder3(hift[0], hift[1], SineNoise(config["hift_noise"], sample_rate), int(config["hift_upsample"]),
                    int(config["hift_f0_lookahead"]), int(config["hift_conv_pre_lookahead"]),
                    int(config["hift_history_frames"]) if "hift_history_frames" in config else None)


def token_filter(config: dict[str, Any]) -> partial[SilentFilter]:
    """A factory of fresh silent filters (one per utterance) with the manifest's codes and run length."""
    return partial(SilentFilter, frozenset(int(t) for t in config.get("silent_tokens", ())),
                   int(config.get("max_silent_run", 5)))


def parts(config: dict[str, Any], tokenizer: Path, hift: tuple[Any, Any], sample_rate: int) -> FamilyParts:
    # `eos` of DecodeConfig is the id masked while step < min_len (choose_token): official v3 masks sos there
    decode = replace(DecodeConfig.from_config(config), eos=int(config["min_len_masked_id"]))
    return FamilyParts(family="cosyvoice3", frontend=TextFrontend3(tokenizer), decode=decode,
                       vocoder=vocoder(config, hift, sample_rate), schedule=ScheduleConfig.from_config(config["stream"]),
                       token_filter=token_filter(config), modes=MODES, min_prompt_seconds=MIN_PROMPT_SECONDS,
                       saved_speaker_quirk=bool(config.get("instruct2_saved_speaker_quirk", True)),
                       languages=("zh", "en", "ja", "ko", "yue", "de", "es", "fr", "it", "ru"),
                       attribution=("FunAudioLLM Fun-CosyVoice3", "https://github.com/FunAudioLLM/CosyVoice"))


def pipeline(bundle: Bundle, selection: str, sessions: SessionConfig) -> CosyVoicePipeline:
    """A `cosyvoice3` bundle's pipeline (families.py)."""
    return CosyVoicePipeline(bundle, selection, sessions, parts)
