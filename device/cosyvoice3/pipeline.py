"""Fun-CosyVoice3 bundles: text -> BPE ids -> speech tokens (LLM) -> silent filter -> mel (flow) -> 24 kHz (HiFT).

Torch-free. The runtime is CosyVoice2's (`cosyvoice2.pipeline.CosyVoice2Pipeline`: the LLM session wrapper with its
KV cache, the cross-request decode scheduler, RAS / greedy sampling, the flow's Euler solver with the fixed CFM
noise, voices and prompt features, batching); this subclass fills in its family hooks with the v3 parameters:

* text: the v3 tokenizer (`cosyvoice3.frontend.TextFrontend3`) and the `<|endofprompt|>` rule (InputError when
  neither the LLM prompt text nor the segment carries it);
* LLM: sos / task_id are rows of speech_embedding (the bundle stores them as CosyVoice2's [2, H] table); decoding
  stops on any id of the 200-id stop set; the min_len guard masks `min_len_masked_id` (6561 = sos: the official
  quirk, so eos is NOT blocked before min_len);
* silent filter between LLM and flow (`cosyvoice3.frontend.SilentFilter`): the LLM conditions on every token;
* vocoder: the causal HiFT with the fixed sine noise (`cosyvoice3.vocoder`), deterministic whatever the request;
* streaming: HiFT re-run on the accumulated mel, only new samples emitted (`cosyvoice3.vocoder.stream_tokens`);
* instruct2 with a bundle voice (an official saved speaker, spk2info): the official frontend replaces the
  instruction by the speaker's prompt text. Reproduced by default (`instruct2_saved_speaker_quirk` in the
  manifest); `Pipeline.instruct2_uses_instruction = True` gives the intended behaviour. Voices registered at run
  time behave like the official prompt-wav path (the instruction is used). An instruction without
  `<|endofprompt|>` (the API's `instructions`, "speak cheerfully") gets the official frame:
  "You are a helpful assistant. <instruction><|endofprompt|>" (the form of every official instruct2 example);
* voice registration: 3-30 s of prompt audio (shorter prompts are refused: the official examples use 3-10 s and
  the zero-shot LLM continues the prompt's speech tokens, which a 1-2 s prompt barely gives it).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.llm import DecodeConfig
from cosyedge.device.cosyvoice2.pipeline import CosyVoice2Pipeline
from cosyedge.device.cosyvoice2.sampling import SamplingConfig
from cosyedge.device.cosyvoice2.voices import ModeInputs, Voice
from cosyedge.device.cosyvoice3.frontend import ENDOFPROMPT, SYSTEM_PROMPT, SilentFilter, TextFrontend3
from cosyedge.device.cosyvoice3.vocoder import SineNoise, Stream3Config, Vocoder3, stream_tokens
from cosyedge.device.errors import InvalidVoiceError
from cosyedge.device.options import Segment, SynthesisOptions
from cosyedge.device.sessions import SessionConfig

MIN_PROMPT_SECONDS = 3.0   # the global registration limits (voice_store) are 1-30 s


class CosyVoice3Pipeline(CosyVoice2Pipeline):
    """One Fun-CosyVoice3 bundle (manifest config keys: docs/bundle_cosyvoice3.md)."""

    family = "cosyvoice3"
    instruct2_uses_instruction = False  # True: instruct2 with a bundle voice keeps the instruction (not official)

    def __init__(self, bundle: Bundle, precision: str, sessions: SessionConfig) -> None:
        cfg = bundle.manifest.config
        self._silent = frozenset(int(t) for t in cfg.get("silent_tokens", ()))
        self._max_silent_run = int(cfg.get("max_silent_run", 5))
        self._saved_speaker_quirk = bool(cfg.get("instruct2_saved_speaker_quirk", True))
        super().__init__(bundle, precision, sessions)

    # -- family hooks -------------------------------------------------------------------------
    def _text_frontend(self, tokenizer_json: Path) -> TextFrontend3:
        return TextFrontend3(tokenizer_json)

    def _decode_config(self, cfg: dict[str, Any]) -> DecodeConfig:
        # `eos` of DecodeConfig is the id masked while step < min_len (choose_token): official v3 masks sos there
        return DecodeConfig(eos=int(cfg["min_len_masked_id"]), stop_ids=frozenset(int(i) for i in cfg["stop_ids"]),
                            min_token_text_ratio=float(cfg["min_token_text_ratio"]),
                            max_token_text_ratio=float(cfg["max_token_text_ratio"]),
                            sampling=SamplingConfig.from_config(cfg["sampling"]))

    def _make_vocoder(self, source: Any, decoder: Any, cfg: dict[str, Any]) -> Vocoder3:
        noise = SineNoise(cfg["hift_noise"], self.sample_rate)
        return Vocoder3(source, decoder, noise, int(cfg["hift_upsample"]), int(cfg["hift_f0_lookahead"]),
                        int(cfg["hift_conv_pre_lookahead"]))

    def _read_stream_config(self, cfg: dict[str, Any]) -> Stream3Config:
        return Stream3Config.from_config(cfg)

    def _lm_input(self, segment: Segment, inputs: ModeInputs) -> np.ndarray:
        self._frontend.check_endofprompt(inputs.prompt_text, segment.ids)
        return super()._lm_input(segment, inputs)

    def _silent_filter(self) -> SilentFilter:
        return SilentFilter(self._silent, self._max_silent_run)

    def _flow_tokens(self, tokens: list[int]) -> list[int]:
        keep = self._silent_filter().keep
        return [int(t) for t in tokens if keep(t)]

    def _mode_inputs(self, request: SynthesisOptions) -> ModeInputs:
        if request.instruct_text and ENDOFPROMPT not in request.instruct_text:
            request = replace(request, instruct_text=f"{SYSTEM_PROMPT} {request.instruct_text}{ENDOFPROMPT}")
        inputs = super()._mode_inputs(request)
        mode = request.mode or ("instruct2" if request.instruct_text else None)
        if (mode == "instruct2" and self._saved_speaker_quirk and not self.instruct2_uses_instruction
                and request.voice in self._bundle_voices):
            voice = self._voices[request.voice]
            return ModeInputs(voice.prompt_text_ids, (), inputs.flow)  # official: spk2info's prompt_text wins
        return inputs

    # -- streaming and voices -------------------------------------------------------------------
    def stream_tokens(self, tokens: Iterable[int], request: SynthesisOptions,
                      rng: np.random.Generator | None = None) -> Iterator[np.ndarray]:
        """Streaming synthesis of an LLM token stream (silent filter applied) in the request's voice and mode."""
        inputs = self._mode_inputs(request)
        yield from stream_tokens(tokens, self._silent_filter().keep, inputs.flow, self._flow, self._vocoder,
                                 self._stream_config, self._chunk_gate)

    def make_voice(self, name: str, wav: np.ndarray, sample_rate: int, prompt_text: str) -> Voice:
        """CosyVoice2's zero-shot voice from 3-30 s of audio; a transcript without `<|endofprompt|>` gets the
        official system prompt before it (the v3 LLM needs the marker in the prompt text)."""
        if wav.size < MIN_PROMPT_SECONDS * sample_rate:
            raise InvalidVoiceError(f"prompt audio is {wav.size / sample_rate:.2f} s long; Fun-CosyVoice3 voices need "
                                    f"{MIN_PROMPT_SECONDS:.0f}-30 s of speech")
        if ENDOFPROMPT not in str(prompt_text):
            prompt_text = f"{SYSTEM_PROMPT}{ENDOFPROMPT}{prompt_text}"
        return super().make_voice(name, wav, sample_rate, prompt_text)
