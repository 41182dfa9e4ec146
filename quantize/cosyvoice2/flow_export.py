"""ONNX export of the CosyVoice2 flow stage: the graph contract between the build host and the runtime.

The flow is split into two graphs so that the 10-step CFG Euler loop runs in numpy on the device (the loop count,
the guidance rate and the fixed noise stay data, not graph structure, and one estimator graph serves every step).

ONNX graphs written by `export_flow` (opset 17, standard ops, float32). Symbols: N tokens that produce mel (prompt
tokens ++ generated tokens), K = pre_lookahead_len (3; metadata `pre_lookahead_len`), T = token_mel_ratio * N mel
frames (metadata `token_mel_ratio`, 2), B batch (the CFG pair, or several requests stacked), E = spk_embed_dim (192),
M = mel bins (80). Flags are int64 [1] with value 0 or 1 (one graph covers both modes; no second variant).

`flow_encoder.onnx` (batch 1)
  inputs   token      int64   [1, N + K]  prompt tokens ++ generated tokens ++ K look-ahead tokens. When finalize=1
                                          the last K entries are placeholders (any id, e.g. 0): the official zero
                                          padding replaces them.
           embedding  float32 [1, E]      speaker embedding (CAM++ / spk2info), not normalised
           finalize   int64   [1]         1: last call of a request (zero look-ahead); 0: streaming chunk whose last K
                                          tokens are look-ahead context
           streaming  int64   [1]         1: chunk-causal attention (streaming chunks); 0: full attention
                                          (non-streaming requests and the final streaming call)
  outputs  mu         float32 [1, M, T]   CFM condition (encoder_proj output, channels first)
           spks       float32 [1, M]      projected speaker embedding

`flow_estimator.onnx` (one velocity evaluation; the Euler loop runs outside, in numpy)
  inputs   x          float32 [B, M, T]   current sample
           mask       float32 [B, 1, T]   1 on real frames, 0 on right padding (rows of different lengths)
           mu         float32 [B, M, T]   encoder output (zeros in the unconditional CFG row)
           t          float32 [B]         flow time of this step
           spks       float32 [B, M]      speaker vector (zeros in the unconditional row)
           cond       float32 [B, M, T]   prompt mel in the first frames, zeros after (all zeros in the uncond. row)
           streaming  int64   [1]         1: chunk-causal attention with metadata `estimator_chunk` frames; 0: full
           past_hidden float32 [L, R, P, D] optional (default: none, P = 0): the prompt state's normalised hidden
                                          states of P frames solved before x, one row per x row (R = B, or 1
                                          broadcast), for the L transformer blocks (flow_estimator.py)
           past_conv  float32 [R, S, 2]   optional (default zeros): those frames' last 2 inputs of each causal
                                          convolution (S: their input channels together)
           keep       int64   [1]         optional (default 0): frames of x whose state the call returns
           past_hidden_q int8 [L, R, Q, D], past_hidden_scale float32 [L, R, Q, 1]  optional (default: none, Q = 0):
                                          more past frames after past_hidden's, as int8 values and one scale per
                                          block, row and frame (device/cosyvoice2/prompt_cache.py `Int8Hidden`);
                                          each block dequantizes only its own
  outputs  velocity   float32 [B, M, T]
           present_hidden float32 [L, B, keep, D], present_conv float32 [B, S, 2]: the state after x's first
                                          `keep` frames (past frames before them)
  The optional inputs are graph initializers (ONNX overridable defaults), so a call without them is the plain
  velocity; CosyVoice3's DiT has none of them. P must be whole `estimator_chunk`s of streaming calls
  (device/cosyvoice2/prompt_cache.py says when that state is the same in every streaming call of a voice).

Graph metadata (`metadata_props`): pre_lookahead_len, token_mel_ratio, n_timesteps, inference_cfg_rate,
encoder_chunk, estimator_chunk, estimator_left_chunks, mel_bins, spk_embed_dim.

The Euler loop for one request, exactly as the official `solve_euler` (float32 throughout):
  t_span = 1 - cos(linspace(0, 1, n_timesteps + 1) * pi/2); x = noise[:, :, :T]   (fixed noise, `fixed_noise()`)
  t = t_span[0]; dt = t_span[1] - t_span[0]
  for step in 1..n_timesteps:
      v = velocity(x=[x, x], mask=[1, 1], mu=[mu, 0], t=[t, t], spks=[spks, 0], cond=[cond, 0])
      x = x + dt * ((1 + r) * v[0] - r * v[1]);  t = t + dt;  dt = t_span[step + 1] - t  (if step < n_timesteps)
  mel = x[:, :, token_mel_ratio * P:]   (P prompt tokens; cond = prompt mel (1, 2P, M) transposed, zero-padded to T)
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from cosyedge.quantize.cosyvoice2.flow import N_TIMESTEPS, CausalMaskedDiffWithXvec
from cosyedge.quantize.cosyvoice2.flow_config import FlowConfig
from cosyedge.quantize.cosyvoice2.flow_estimator import PromptState
from cosyedge.quantize.cosyvoice2.onnx_export import trace_to_onnx

ENCODER_NAME = "flow_encoder"
ESTIMATOR_NAME = "flow_estimator"


class EncoderGraph(nn.Module):
    def __init__(self, flow: CausalMaskedDiffWithXvec) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, token: torch.Tensor, embedding: torch.Tensor, finalize: torch.Tensor, streaming: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.flow.encode(token, embedding, finalize, streaming)


class EstimatorGraph(nn.Module):
    def __init__(self, flow: CausalMaskedDiffWithXvec) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, streaming: torch.Tensor) -> torch.Tensor:
        return self.flow.velocity(x, mask, mu, t, spks, cond, streaming)


class PromptStateEstimatorGraph(EstimatorGraph):
    """The estimator with the prompt state's inputs and outputs (CosyVoice2)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,  # type: ignore[override]
                spks: torch.Tensor, cond: torch.Tensor, streaming: torch.Tensor, past_hidden: torch.Tensor,
                past_conv: torch.Tensor, keep: torch.Tensor, past_hidden_q: torch.Tensor,
                past_hidden_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = PromptState(past_hidden, past_conv, keep, past_hidden_q, past_hidden_scale)  # block by block
        velocity = self.flow.velocity(x, mask, mu, t, spks, cond, streaming, state)
        return (velocity, *state.outputs())


STATE_DEFAULTS = ("past_hidden", "past_conv", "keep", "past_hidden_q", "past_hidden_scale")


def _state_defaults(layers: int, width: int, channels: int) -> Callable[[onnx.ModelProto], None]:
    """The prompt state's inputs become overridable initializers: none past, zero convolution history, keep 0."""
    def edit(model: onnx.ModelProto) -> None:
        defaults = {"past_hidden": np.zeros((layers, 1, 0, width), np.float32),
                    "past_conv": np.zeros((1, channels, 2), np.float32), "keep": np.zeros(1, np.int64),
                    "past_hidden_q": np.zeros((layers, 1, 0, width), np.int8),
                    "past_hidden_scale": np.zeros((layers, 1, 0, 1), np.float32)}
        model.graph.initializer.extend(onnx.numpy_helper.from_array(value, name) for name, value in defaults.items())
    return edit


def graph_metadata(c: FlowConfig) -> dict[str, str]:
    """What the runtime needs beside the graphs (written into both files' metadata_props)."""
    return {
        "pre_lookahead_len": str(c.pre_lookahead_len), "token_mel_ratio": str(c.token_mel_ratio),
        "n_timesteps": str(N_TIMESTEPS), "inference_cfg_rate": repr(c.inference_cfg_rate),
        "encoder_chunk": str(c.encoder.static_chunk_size), "estimator_chunk": str(c.estimator.static_chunk_size),
        "estimator_left_chunks": str(c.estimator.num_decoding_left_chunks), "mel_bins": str(c.mel_bins),
        "spk_embed_dim": str(c.spk_embed_dim),
    }


def export_flow(module: CausalMaskedDiffWithXvec, out_dir: Path) -> dict[str, Path]:
    """Write flow_encoder.onnx and flow_estimator.onnx (signatures in the module docstring) into out_dir.

    Traced with the TorchScript exporter; example shapes use distinct sizes so that no dynamic dimension is
    specialised, and both flags are graph inputs (one graph covers streaming and non-streaming calls).
    """
    return export_flow_graphs(module, out_dir, graph_metadata(module.config), frames=2 * 7, prompt_state=True)


def _fix_encoder(model: onnx.ModelProto) -> None:
    """The tracer leaves mu's batch axis unnamed (it is 1), and drops `streaming` where the encoder ignores it
    (CosyVoice3): restored, so that one runtime feeds every family's encoder the same inputs."""
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 1
    if "streaming" not in [i.name for i in model.graph.input]:
        model.graph.input.append(onnx.helper.make_tensor_value_info("streaming", onnx.TensorProto.INT64, [1]))


def export_flow_graphs(module: nn.Module, out_dir: Path, metadata: dict[str, str], frames: int,
                       prompt_state: bool = False) -> dict[str, Path]:
    """The two flow graphs of any flow with CosyVoice2's `encode` / `velocity` signatures (CosyVoice2 and 3),
    `metadata` in both files; the estimator is traced on `frames` example frames at batch 3, with the prompt
    state's inputs and outputs when `prompt_state` (traced on 5 past frames, 2 kept)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    module = module.eval()
    c = module.config
    b, size = 3, frames
    flag = torch.ones(1, dtype=torch.int64)
    estimator_args = (torch.randn(b, c.mel_bins, size), torch.ones(b, 1, size), torch.randn(b, c.mel_bins, size),
                      torch.rand(b), torch.randn(b, c.mel_bins), torch.randn(b, c.mel_bins, size), flag)
    estimator_inputs = ["x", "mask", "mu", "t", "spks", "cond", "streaming"]
    estimator_outputs = ["velocity"]
    estimator_axes = ({name: {0: "batch", 2: "frames"} for name in ("x", "mask", "mu", "cond", "velocity")}
                      | {"t": {0: "batch"}, "spks": {0: "batch"}})
    estimator, edit = EstimatorGraph(module), None  # type: ignore[arg-type]
    if prompt_state:
        net = module.decoder.estimator
        layers, width, channels = net.layers(), net.config.channels, net.conv_channels()
        estimator, edit = PromptStateEstimatorGraph(module), _state_defaults(layers, width, channels)  # type: ignore[arg-type]
        estimator_args += (torch.randn(layers, b, 5, width), torch.randn(b, channels, 2), torch.tensor([2]),
                           torch.randint(-127, 128, (layers, b, 4, width), dtype=torch.int8),
                           torch.rand(layers, b, 4, 1) / 127)
        estimator_inputs += list(STATE_DEFAULTS)
        estimator_outputs += ["present_hidden", "present_conv"]
        estimator_axes |= {"past_hidden": {1: "state_rows", 2: "past"}, "past_conv": {0: "state_rows"},
                           "past_hidden_q": {1: "q_rows", 2: "past_q"},
                           "past_hidden_scale": {1: "q_rows", 2: "past_q"},
                           "present_hidden": {1: "batch", 2: "kept"}, "present_conv": {0: "batch"}}
    jobs = {
        ENCODER_NAME: (
            EncoderGraph(module),  # type: ignore[arg-type]  # duck-typed: every flow has the same encode
            (torch.randint(0, c.vocab_size, (1, 7 + c.pre_lookahead_len)), torch.randn(1, c.spk_embed_dim), flag,
             flag),
            ["token", "embedding", "finalize", "streaming"], ["mu", "spks"],
            {"token": {1: "tokens"}, "mu": {2: "frames"}}, _fix_encoder),
        ESTIMATOR_NAME: (estimator, estimator_args, estimator_inputs, estimator_outputs, estimator_axes, edit),
    }
    return {name: trace_to_onnx(graph, args, out_dir / f"{name}.onnx", inputs, outputs, axes, metadata, edit)
            for name, (graph, args, inputs, outputs, axes, edit) in jobs.items()}
