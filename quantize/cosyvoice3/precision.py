"""Precision targets (`cpu`, `gpu-fp16`, `trt-int8`) of a `cosyvoice3` bundle, on CosyVoice2's machinery.

The ladders, the transforms, the ladder walk and the gates are CosyVoice2's (`cosyvoice2.precision`,
`precision_targets`, `precision_transforms`, `gates`): the graph names and their signatures are the same, and so is
the Euler loop the flow gate runs. Two things differ and live here:

* node-name rules (`CV3_RULES`): the estimator is a DiT, not a U-Net. Its fp16 graph keeps in fp32 everything
  that carries the residual stream or its statistics: the LayerNorms (LayerNormalization is fp32 in every fp16
  graph), the AdaLN-Zero modulation and gating and the residual adds (block-level glue nodes), the time
  embedding, the RoPE tables and the output projection. fp16 layer norms / residuals overflow in the official
  TensorRT fp16 DiT (NaN audio); tests/quantize/test_cv3_precision.py drives the graph past fp16 range to show the
  islands hold. int8 leaves out the time embedding and the output projection; the AdaLN linears ARE int8: at full
  size they hold 138 M of the DiT's 332 M weights (554 MB of a 760 MB int8 graph when kept fp32).
* the HiFT gates (`Gates3`): `hift_source` takes the release's FIXED sine noise rows instead of a per-call noise
  tensor, so reference and candidate are fed the same rows the device regenerates (`SineNoise`).
* memory at full size (the 22-block DiT, static QDQ for trt-int8): ORT's MinMax calibrator holds every intermediate tensor of every
  calibration feed at once (its chunked mode, `CalibMaxIntermediateOutputs`, discards data in ORT 1.32), so the DiT
  is calibrated on every other Euler step of CosyVoice2's calibration runs (both utterances, both masks); and the
  fp32 LLM sessions are closed once the LLM gate has its reference (the first full-size build was OOM-killed at
  10.4 GB with them open during the flow calibration).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cosyedge.device.cosyvoice3.vocoder import SineNoise
from cosyedge.quantize.cosyvoice2.gates import GateConfig, Gates, StageReport
from cosyedge.quantize.cosyvoice2.precision_targets import FP32_NAMES, INT8_EXCLUDE, STAGE_GRAPHS, TOP_LEVEL, GraphRules

FLOW_CALIBRATION_STRIDE = 2
_BLOCK_GLUE = r"^/estimator/transformer_blocks\.\d+/[A-Za-z]+(_\d+)?$"   # LN, modulation, gates, residual adds
# The cpu DiT is dynamic int8 as CosyVoice2's estimator (no calibration): one full-size call (batch 2, 700 frames,
# 2 threads) took 1.49 s against 2.97 s for the static QDQ graph (its unfused DequantizeLinear nodes) and 3.92 s in
# fp32, at relative error 0.011 against the static graph's 0.018. The cpu LLM takes the shared key/value cache where
# the head size allows, as CosyVoice2's (the v3 LLM is the same Qwen2 graph). trt-int8 keeps static QDQ.
CV3_RULES = GraphRules(
    int8_exclude={**INT8_EXCLUDE,
                  "flow_encoder": (r"^/spk_embed_affine_layer/", r"^/input_embedding/"),
                  # the attention products stay float: int8 on them would hide the attention from the fusion into
                  # ORT's MultiHeadAttention (fused_attention below), and int8 attention was slower (issue 12)
                  "flow_estimator": (r"/time_embed/", r"^/estimator/proj_out/", r"/attn/MatMul(_1)?$")},
    fp32_names={**FP32_NAMES,
                "flow_encoder": (TOP_LEVEL, r"^/spk_embed_affine_layer/", r"^/input_embedding/"),
                "flow_estimator": (TOP_LEVEL, r"norm", r"/time_embed/", r"/rotary_embed/", _BLOCK_GLUE,
                                   r"^/estimator/[A-Za-z]+(_\d+)?$", r"^/estimator/proj_out/")},
    dynamic_int8=frozenset({"flow_estimator"}),
    fused_attention=frozenset({"flow_estimator"}),  # the DiT's attention through ORT's MultiHeadAttention (cpu)
    shared_kv=frozenset({"llm"}),
    cpu_fp32=frozenset({"flow_encoder"}),  # the pre-lookahead layer: small, and static QDQ would need calibration
)


class Gates3(Gates):
    """CosyVoice2's gates with the v3 HiFT source signature (`mel`, `sine_noise` -> `source`, `f0`)."""

    def __init__(self, config: GateConfig, fp32: dict[str, Path], noise: SineNoise) -> None:
        super().__init__(config, fp32)
        self._noise = noise

    def _source(self, graphs: dict[str, Path], mel: np.ndarray) -> np.ndarray:
        rows = self._noise.rows(mel.shape[2] * self.config.hift_upsample)
        return self.run(graphs["hift_source"], {"mel": mel, "sine_noise": rows})[0]

    def wave(self, graphs: dict[str, Path], mel: np.ndarray) -> np.ndarray:
        return self.run(graphs["hift_decoder"], {"mel": mel, "source": self._source(graphs, mel)})[0][0]

    def hift_calibration(self, mels: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
        return [{"mel": m, "source": self._source(self.fp32, m)} for m in mels]

    def flow_calibration(self) -> tuple[list[dict[str, np.ndarray]], list[np.ndarray]]:
        feeds, mels = super().flow_calibration()
        return feeds[::FLOW_CALIBRATION_STRIDE], mels

    def check(self, stage: str, graphs: dict[str, Path], precision: str) -> StageReport:
        report = super().check(stage, graphs, precision)
        if stage == "llm":   # reference logits are cached; a later need re-opens them
            self.forget(self.fp32[g] for g in STAGE_GRAPHS["llm"])
        return report
