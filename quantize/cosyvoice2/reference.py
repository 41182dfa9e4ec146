"""The PyTorch reference pipeline of a CosyVoice2 release: the baseline `cosyedge bench --reference` measures.

It runs the release's own weights in our torch modules (fp32, `build_llm` / `build_flow` / `build_hift`) the way the
official `CosyVoice2` inference does: the text frontend splits the text into segments; per segment the Qwen2 LM
prefills and decodes speech tokens one at a time with a growing KV cache (greedy or the release's RAS sampler),
the flow solves its 10 CFG Euler steps from the fixed noise, and HiFT vocodes. Streaming follows the official v2
chunk schedule (flow re-run on all tokens so far, HiFT caches and cross-fade); the schedule and cache glue are the
runtime's (`device.cosyvoice2.streaming`), the compute is torch. Only what is timed differs from the runtime, so
the bench's ratios compare the engines, not the recipes.

Worker process: `python -m cosyedge.quantize.cosyvoice2.reference --worker RELEASE_DIR --threads 2` speaks the bench
protocol of `cosyedge.device.bench.worker.serve` (torch lives only in this process).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from cosyedge.device.bench.clocks import StageClock
from cosyedge.device.bench.worker import Backend, Settings, serve
from cosyedge.device.cosyvoice2.flow import FlowConfig as RuntimeFlowConfig
from cosyedge.device.cosyvoice2.flow import FlowPrompt, StepRunner
from cosyedge.device.cosyvoice2.frontend import TextFrontend
from cosyedge.device.cosyvoice2.sampling import SamplingConfig, choose_token, without_stops
from cosyedge.device.cosyvoice2.streaming import ScheduleConfig, stream_tokens
from cosyedge.device.cosyvoice2.vocoder import HiftCache, VocoderStream
from cosyedge.device.cosyvoice2.voices import ModeInputs, Voice
from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.bundle import STREAM, _sampling
from cosyedge.quantize.cosyvoice2.flow import N_TIMESTEPS, CausalMaskedDiffWithXvec, build_flow, fixed_noise
from cosyedge.quantize.cosyvoice2.hift import HiFTGenerator, build_hift
from cosyedge.quantize.cosyvoice2.llm import Qwen2LM, build_llm
from cosyedge.quantize.cosyvoice2.release import Release
from cosyedge.quantize.cosyvoice2.tokenizer import write_tokenizer_json

STAGE_GRAPHS = ("llm", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder")


def release_voices(release: Release) -> list[Voice]:
    """spk2info.pt entries as runtime voices (same order and content as the bundle's voice files)."""
    if not release.has_spk2info:
        raise ReleaseError("spk2info.pt: missing; the reference needs a release voice")
    spk2info = torch.load(release.root / "spk2info.pt", map_location="cpu", weights_only=True)
    voices = []
    for name, entry in spk2info.items():
        flat = {k: v.detach().cpu().numpy() for k, v in entry.items() if isinstance(v, torch.Tensor)}
        if "llm_prompt_speech_token" in flat:
            ids = tuple(int(i) for i in flat["prompt_text"].reshape(-1))
            voices.append(Voice(str(name), "zero_shot", flat["flow_embedding"].reshape(-1).astype(np.float32),
                                prompt_text="", prompt_text_ids=ids,
                                llm_prompt_speech=tuple(int(t) for t in flat["llm_prompt_speech_token"].reshape(-1)),
                                flow_prompt_speech=flat["flow_prompt_speech_token"].reshape(-1).astype(np.int64),
                                prompt_mel=flat["prompt_speech_feat"][0].astype(np.float32)))
        elif "embedding" in flat:
            voices.append(Voice(str(name), "sft", flat["embedding"].reshape(-1).astype(np.float32)))
    if not voices:
        raise ReleaseError("spk2info.pt: no usable voice")
    return voices


@dataclass(frozen=True)
class _TorchFlow:
    """The flow module behind the runtime's `Flow.mel` signature (for the shared streaming schedule), timed."""
    module: CausalMaskedDiffWithXvec
    noise: torch.Tensor
    config: RuntimeFlowConfig
    clock: StageClock

    def mel(self, prompt: FlowPrompt, tokens: np.ndarray, finalize: bool, streaming: bool,
            preset: object = None, start: int = 0, run_step: StepRunner | None = None) -> np.ndarray:
        """The official recipe only: no flow preset, no bounded re-solve. `run_step` (the gate's turn for a later
        chunk's estimator steps) runs the whole solve as one step: the official module's Euler loop has no hook
        between steps, and a torch call cannot be stopped midway (the run options it is handed go unread)."""
        if preset is not None or start:
            raise ValueError("the PyTorch reference runs the official flow recipe only")

        def solve(_options: object) -> np.ndarray:
            with self.clock.timed("flow"):
                return self._mel(prompt, tokens, finalize, streaming)
        return solve(None) if run_step is None else run_step(solve)

    def mels(self, prompts: Sequence[FlowPrompt], token_rows: Sequence[np.ndarray], preset: object = None,
             streaming: bool = False) -> list[np.ndarray]:
        """The runtime's batched `Flow.mels` (the streaming gate solves waiting first chunks together), one official
        solve per row: the reference has no padded batch."""
        return [self.mel(prompt, tokens, not streaming, streaming, preset)
                for prompt, tokens in zip(prompts, token_rows)]

    def _mel(self, prompt: FlowPrompt, tokens: np.ndarray, finalize: bool, streaming: bool) -> np.ndarray:
        mel = self.module.inference(
            torch.as_tensor(np.asarray(tokens, np.int64)).reshape(1, -1),
            torch.as_tensor(prompt.tokens.astype(np.int64)).reshape(1, -1),
            torch.as_tensor(prompt.mel).reshape(1, *prompt.mel.shape),
            torch.as_tensor(prompt.embedding).reshape(1, -1), self.noise, streaming=streaming, finalize=finalize)
        return mel.numpy()


@dataclass(frozen=True)
class _TorchVocoder:
    """HiFT behind the runtime's `Vocoder` signature, timed; the NSF noise is zeros or a draw from the request's
    rng."""
    module: HiFTGenerator
    samples_per_frame: int
    clock: StageClock
    cache: HiftCache

    def source(self, mel: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        shape = (mel.shape[0], mel.shape[2] * self.samples_per_frame, self.module.cfg.nb_harmonics + 1)
        noise = np.zeros(shape, np.float32) if rng is None else rng.standard_normal(shape, dtype=np.float32)
        with self.clock.timed("hift"):
            source, _ = self.module.source(torch.as_tensor(mel), torch.as_tensor(noise))
        return source.numpy()

    def decode(self, mel: np.ndarray, source: np.ndarray, options: object = None) -> np.ndarray:
        """`options` (a later chunk's run options) is not used: a torch call cannot be stopped midway."""
        with self.clock.timed("hift"):
            return self.module.decode(torch.as_tensor(mel), torch.as_tensor(source)).numpy()

    def render(self, mel: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        mel = np.ascontiguousarray(mel, np.float32)
        return self.decode(mel, self.source(mel, rng))[0]

    def stream(self, rng: np.random.Generator | None) -> VocoderStream:
        return VocoderStream(self, self.cache, rng)


class ReferencePipeline(Backend):
    """One release in torch fp32, the first release voice in its default mode; safe for several threads."""

    def __init__(self, release_dir: Path | str, threads: int = 2) -> None:
        torch.set_num_threads(threads)
        self.clock = StageClock()
        release = Release.open(release_dir)
        self._name = release.root.name
        self._work = tempfile.TemporaryDirectory(prefix="cosyedge-reference-")
        tokenizer = write_tokenizer_json(release.root / "CosyVoice-BlankEN", Path(self._work.name) / "tokenizer.json")
        self._frontend = TextFrontend(tokenizer)
        self._lm: Qwen2LM = build_llm(release)
        flow = build_flow(release)
        hift = build_hift(release)
        c = flow.config
        self._flow = _TorchFlow(flow, torch.from_numpy(fixed_noise()),
                                RuntimeFlowConfig(c.token_mel_ratio, c.pre_lookahead_len, N_TIMESTEPS,
                                                  c.inference_cfg_rate), self.clock)
        self._vocoder = _TorchVocoder(hift, hift.cfg.samples_per_frame, self.clock, HiftCache.from_config(STREAM))
        self._sampling = SamplingConfig.from_config(_sampling(release.hparams))
        self._stream = ScheduleConfig.from_config({**STREAM, "lookahead": c.pre_lookahead_len})
        voice = release_voices(release)[0]
        self._inputs: ModeInputs = voice.inputs(None, (), c.mel_bins)
        self.sample_rate = int(release.hparams["sample_rate"])
        self.samples_per_token = hift.cfg.samples_per_frame * c.token_mel_ratio
        self.warm_up()

    def describe(self) -> dict[str, Any]:
        return {"backend": "reference", "bundle": self._name, "precision": dict.fromkeys(STAGE_GRAPHS, "fp32"),
                "sample_rate": self.sample_rate, "torch": torch.__version__}

    def synthesize(self, text: str, stream: bool, settings: Settings, index: int) -> tuple[int, Iterator[np.ndarray]]:
        with self.clock.timed("frontend"):
            segments = [s for s in self._frontend.normalize(text, split=True) if self._frontend.encode(s)]
            ids = [self._frontend.encode(s) for s in segments]
        rng = np.random.default_rng(settings.seed + index)
        noise_rng = None if settings.sampling == "greedy" else rng
        return len(ids), self._chunks(ids, stream, settings, rng, noise_rng)

    def _chunks(self, segments: Sequence[list[int]], stream: bool, settings: Settings, rng: np.random.Generator,
                noise_rng: np.random.Generator | None) -> Iterator[np.ndarray]:
        with torch.inference_mode():  # grad mode is per thread: set it in the request's own thread
            for segment in segments:
                tokens = self._tokens(segment, settings, rng)
                if stream:
                    yield from stream_tokens(tokens, self._inputs.flow, self._flow,  # type: ignore[arg-type]
                                             self._vocoder.stream(noise_rng), self._stream)
                    continue
                generated = np.asarray(list(tokens), np.int64)
                if generated.size:
                    mel = self._flow.mel(self._inputs.flow, generated, finalize=True, streaming=False)
                    yield self._vocoder.render(mel, noise_rng)

    def _tokens(self, segment: Sequence[int], settings: Settings, rng: np.random.Generator) -> Iterator[int]:
        """Official decoding: prefill, then one position per token; stop ids masked when the length is pinned."""
        lm, config = self._lm, self._lm.config
        pin = settings.tokens
        min_len, max_len = (pin, pin) if pin is not None else config.min_max_len(len(segment))
        with self.clock.timed("llm_prefill"):
            logits, key, value = lm.prefill(lm.lm_input(segment, self._inputs.prompt_text, self._inputs.prompt_speech))
        history: list[int] = []
        for step in range(max_len):
            scores = logits[0].numpy()
            if pin is not None:
                scores = without_stops(scores, config.stop_ids)
            token = choose_token(scores, step, min_len, config.min_len_masked_id, history, settings.sampling == "greedy",
                                 self._sampling, rng)
            if token in config.stop_ids:
                return
            history.append(token)
            yield token
            if step + 1 == max_len:
                return
            with self.clock.timed("llm_decode"):
                logits, key, value = lm.decode_step(lm.token_embedding(token), key, value)


def worker_main(module: str, pipeline: Callable[[Path, int], object], argv: list[str] | None = None) -> int:
    """`python -m <module> --worker RELEASE_DIR`: a reference bench worker over the release (both families)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}",
                                     description="PyTorch reference bench worker (internal to cosyedge bench)")
    parser.add_argument("--worker", required=True, metavar="RELEASE_DIR")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    return serve(lambda: pipeline(Path(args.worker), args.threads))


def main(argv: list[str] | None = None) -> int:
    return worker_main("cosyedge.quantize.cosyvoice2.reference", ReferencePipeline, argv)


if __name__ == "__main__":
    sys.exit(main())
