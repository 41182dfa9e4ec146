"""The PyTorch reference pipeline of a Fun-CosyVoice3 release: the baseline `cosyedge bench --reference` measures
for `cosyvoice3` bundles.

CosyVoice2's reference (`cosyvoice2.reference.ReferencePipeline`: frontend, KV-cache decoding with the release's
sampler, the torch flow behind the runtime's `Flow.mel` signature, the bench protocol) with the v3 parts: the v3
tokenizer and `<|endofprompt|>` prompts (the first spk2info voice), the silent-token filter between LLM and flow,
the causal HiFT with its fixed noise (official `inference`, finalize on or off), and the v3 streaming rule (HiFT
re-run on the accumulated mel, only new samples emitted; the schedule glue is the runtime's stream loop
`device.cosyvoice2.streaming.stream_tokens` with `device.cosyvoice3.vocoder.RerunStream`, the compute is torch).

Worker process: `python -m cosyedge.quantize.cosyvoice3.reference --worker RELEASE_DIR --threads 2`.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from cosyedge.device.bench.clocks import StageClock
from cosyedge.device.bench.worker import Settings
from cosyedge.device.cosyvoice2.flow import FlowConfig as RuntimeFlowConfig, StepRunner
from cosyedge.device.cosyvoice2.sampling import SamplingConfig
from cosyedge.device.cosyvoice2.streaming import ScheduleConfig, stream_tokens
from cosyedge.device.cosyvoice3.frontend import SilentFilter, TextFrontend3
from cosyedge.device.cosyvoice3.vocoder import RerunStream
from cosyedge.quantize.cosyvoice2.bundle import _sampling
from cosyedge.quantize.cosyvoice2.flow import N_TIMESTEPS, fixed_noise
from cosyedge.quantize.cosyvoice2.reference import ReferencePipeline, _TorchFlow, release_voices, worker_main
from cosyedge.quantize.cosyvoice3.bundle import MAX_SILENT_RUN, SILENT_TOKENS, STREAM
from cosyedge.quantize.cosyvoice3.hift import CausalHiFTGenerator
from cosyedge.quantize.cosyvoice3.models import load_models
from cosyedge.quantize.cosyvoice3.release import YAML_NAME
from cosyedge.quantize.cosyvoice3.tokenizer import write_tokenizer_json


@dataclass(frozen=True)
class _TorchVocoder3:
    """The causal HiFT behind the runtime's `Vocoder3.run` signature (official `inference`), timed."""
    module: CausalHiFTGenerator
    clock: StageClock

    def run(self, mel: np.ndarray, finalize: bool, start: int = 0, run_step: StepRunner | None = None
            ) -> np.ndarray:
        """The official inference on all of `mel`; the samples from frame `start` on. `run_step` (the gate's turn
        for a later chunk) runs the whole inference as one call: a torch call cannot be stopped midway."""
        def infer(_options: object = None) -> np.ndarray:
            with self.clock.timed("hift"):
                speech, _, _ = self.module.inference(torch.as_tensor(np.ascontiguousarray(mel, np.float32)), finalize)
            return speech[0, start * self.module.cfg.samples_per_frame:].numpy()

        return infer() if run_step is None else run_step(infer)


class ReferencePipeline3(ReferencePipeline):
    """One Fun-CosyVoice3 release in torch fp32, the first release voice zero-shot; safe for several threads."""

    def __init__(self, release_dir: Path | str, threads: int = 2) -> None:  # noqa: super-init-not-called
        torch.set_num_threads(threads)
        self.clock = StageClock()
        models = load_models(release_dir)
        release = models.release
        self._name = release.root.name
        self._work = tempfile.TemporaryDirectory(prefix="cosyedge-reference-")
        tokenizer = write_tokenizer_json(release.root / "CosyVoice-BlankEN", Path(self._work.name) / "tokenizer.json")
        self._frontend = TextFrontend3(tokenizer)
        self._lm = models.llm
        c = models.flow.config
        self._flow = _TorchFlow(models.flow, torch.from_numpy(fixed_noise()),  # type: ignore[arg-type]
                                RuntimeFlowConfig(c.token_mel_ratio, c.pre_lookahead_len, N_TIMESTEPS,
                                                  c.inference_cfg_rate), self.clock)
        self._vocoder = _TorchVocoder3(models.hift, self.clock)
        self._sampling = SamplingConfig.from_config(_sampling(release.hparams, YAML_NAME))
        self._stream = ScheduleConfig.from_config({**STREAM, "lookahead": c.pre_lookahead_len})
        self._inputs = release_voices(release)[0].inputs(None, (), c.mel_bins)
        self.sample_rate = int(release.hparams["sample_rate"])
        self.samples_per_token = models.hift.cfg.samples_per_frame * c.token_mel_ratio
        self.warm_up()

    def _chunks(self, segments: Sequence[list[int]], stream: bool, settings: Settings, rng: np.random.Generator,
                noise_rng: np.random.Generator | None) -> Iterator[np.ndarray]:
        """Per segment: LLM tokens -> silent filter -> flow -> HiFT (the v3 noise is fixed: `noise_rng` unused)."""
        with torch.inference_mode():  # grad mode is per thread: set it in the request's own thread
            for segment in segments:
                tokens = self._tokens(segment, settings, rng)
                silent = SilentFilter(frozenset(SILENT_TOKENS), MAX_SILENT_RUN)
                if stream:
                    yield from stream_tokens(tokens, self._inputs.flow, self._flow,  # type: ignore[arg-type]
                                             RerunStream(self._vocoder, self._vocoder.module.cfg.samples_per_frame),
                                             self._stream, silent)
                    continue
                generated = np.asarray([t for t in tokens if silent.keep(t)], np.int64)
                if generated.size:
                    mel = self._flow.mel(self._inputs.flow, generated, finalize=True, streaming=False)
                    yield self._vocoder.run(mel, finalize=True)


def main(argv: list[str] | None = None) -> int:
    return worker_main("cosyedge.quantize.cosyvoice3.reference", ReferencePipeline3, argv)


if __name__ == "__main__":
    sys.exit(main())
