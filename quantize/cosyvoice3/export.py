"""ONNX export of the Fun-CosyVoice3 LLM and flow stages: the graph contract between the build host and the runtime.

Most of the contract is CosyVoice2's, because the computation is: the LLM graphs are `cosyvoice2.llm_export`'s
(the same Qwen2 causal pass with explicit KV caches, speech logits only), the flow graphs are built from
`cosyvoice2.flow_export`'s wrappers (the v3 flow keeps the `encode` / `velocity` signatures). What differs:

LLM (`llm_prefill.onnx`, `llm_decode.onnx`; signatures in `cosyvoice2.llm_export`)
  * logits are [B, V] with V = speech_token_size + S (6761 officially: S special ids, all stop ids);
  * there is no `llm_embedding` table: sos (speech_token_size) and task_id (+2) are rows of `speech_embedding`,
    so `embedding_tables` returns only `embed_tokens` and `speech_embedding`;
  * greedy decoding: the id masked while step < min_len is speech_token_size (sos in v3, the official quirk),
    and decoding stops on ANY id >= speech_token_size (metadata `stop_id_min` / `stop_id_max`).

Flow (`flow_encoder.onnx`, `flow_estimator.onnx`; signatures as in `cosyvoice2.flow_export`)
  * `flow_encoder`: token [1, N + K] (last K look-ahead, placeholders when finalize=1), embedding [1, E],
    finalize [1], streaming [1] -> mu [1, M, ratio*N], spks [1, M]. `streaming` is accepted for the shared
    signature but does not change mu (no attention before the DiT: PreLookaheadLayer + repeat only).
  * `flow_estimator`: the DiT; `streaming` 1 = chunk-causal attention over `estimator_chunk` frames (every
    earlier chunk visible), 0 = full attention. One graph covers both masks.
  * metadata: pre_lookahead_len, token_mel_ratio, n_timesteps, inference_cfg_rate, estimator_chunk,
    estimator_left_chunks (-1), mel_bins, spk_embed_dim. The Euler loop is CosyVoice2's (same fixed noise).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

from cosyedge.quantize.cosyvoice2.flow import N_TIMESTEPS
from cosyedge.quantize.cosyvoice2.flow_export import ENCODER_NAME, ESTIMATOR_NAME, EncoderGraph, EstimatorGraph
from cosyedge.quantize.cosyvoice2.llm_export import DECODE_NAME, PREFILL_NAME, export_llm as _export_llm_graphs
from cosyedge.quantize.cosyvoice3.flow import CausalMaskedDiffWithDiT, Flow3Config
from cosyedge.quantize.cosyvoice3.llm import CosyVoice3LM

ONNX_OPSET = 17

__all__ = ["DECODE_NAME", "ENCODER_NAME", "ESTIMATOR_NAME", "PREFILL_NAME", "embedding_tables", "export_flow",
           "export_llm", "flow_metadata", "llm_metadata"]


def embedding_tables(module: CosyVoice3LM) -> dict[str, np.ndarray]:
    """float32 tables the runtime gathers from: embed_tokens [text vocab, H], speech_embedding [V, H]
    (rows speech_token_size = sos and +2 = task_id hold what CosyVoice2 kept in `llm_embedding`)."""
    return {
        "embed_tokens": module.body.embed_tokens.weight.detach().cpu().numpy().astype(np.float32),
        "speech_embedding": module.speech_embedding.weight.detach().cpu().numpy().astype(np.float32),
    }


def llm_metadata(module: CosyVoice3LM) -> dict[str, str]:
    """The special ids and length rule the runtime needs beside the graphs."""
    c = module.config
    return {"speech_token_size": str(c.speech_token_size), "sos": str(c.sos), "eos": str(c.eos),
            "task_id": str(c.task_id), "fill": str(c.fill), "stop_id_min": str(c.speech_token_size),
            "stop_id_max": str(c.speech_vocab - 1), "min_len_masked_id": str(c.min_len_masked_id),
            "min_token_text_ratio": repr(c.min_token_text_ratio),
            "max_token_text_ratio": repr(c.max_token_text_ratio)}


def _set_metadata(path: Path, meta: dict[str, str], encoder: bool = False) -> None:
    model = onnx.load(str(path))
    if encoder:
        model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 1  # the tracer leaves mu's batch unnamed
        if "streaming" not in [i.name for i in model.graph.input]:
            # unused by the v3 encoder, so the tracer dropped it; kept so that one runtime feeds both families
            model.graph.input.append(onnx.helper.make_tensor_value_info("streaming", onnx.TensorProto.INT64, [1]))
    onnx.helper.set_model_props(model, meta)
    onnx.save(model, str(path))


def export_llm(module: CosyVoice3LM, out_dir: Path) -> dict[str, Path]:
    """Write llm_prefill.onnx and llm_decode.onnx (CosyVoice2's graphs over the v3 module) with v3 metadata."""
    paths = _export_llm_graphs(module, Path(out_dir))
    for path in paths.values():
        _set_metadata(path, llm_metadata(module))
    return paths


def flow_metadata(c: Flow3Config) -> dict[str, str]:
    """What the runtime needs beside the flow graphs (written into both files' metadata_props)."""
    return {
        "pre_lookahead_len": str(c.pre_lookahead_len), "token_mel_ratio": str(c.token_mel_ratio),
        "n_timesteps": str(N_TIMESTEPS), "inference_cfg_rate": repr(c.inference_cfg_rate),
        "estimator_chunk": str(c.estimator.static_chunk_size), "estimator_left_chunks": "-1",
        "mel_bins": str(c.mel_bins), "spk_embed_dim": str(c.spk_embed_dim),
    }


def export_flow(module: CausalMaskedDiffWithDiT, out_dir: Path) -> dict[str, Path]:
    """Write flow_encoder.onnx and flow_estimator.onnx (signatures in the module docstring) into out_dir.

    Traced with the TorchScript exporter; the example length (2 x 37 = 74 frames) crosses a 50-frame chunk
    boundary and no example size equals another, so no dynamic dimension is specialised.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    module = module.eval()
    c = module.config
    b, size = 3, 2 * 37
    flag = torch.ones(1, dtype=torch.int64)
    jobs = {
        ENCODER_NAME: (
            EncoderGraph(module),  # type: ignore[arg-type]  # duck-typed: the v3 flow has the same encode
            (torch.randint(0, c.vocab_size, (1, 7 + c.pre_lookahead_len)), torch.randn(1, c.spk_embed_dim), flag,
             flag),
            ["token", "embedding", "finalize", "streaming"], ["mu", "spks"],
            {"token": {1: "tokens"}, "mu": {2: "frames"}}),
        ESTIMATOR_NAME: (
            EstimatorGraph(module),  # type: ignore[arg-type]
            (torch.randn(b, c.mel_bins, size), torch.ones(b, 1, size), torch.randn(b, c.mel_bins, size),
             torch.rand(b), torch.randn(b, c.mel_bins), torch.randn(b, c.mel_bins, size), flag),
            ["x", "mask", "mu", "t", "spks", "cond", "streaming"], ["velocity"],
            {name: {0: "batch", 2: "frames"} for name in ("x", "mask", "mu", "cond", "velocity")}
            | {"t": {0: "batch"}, "spks": {0: "batch"}}),
    }
    paths: dict[str, Path] = {}
    for name, (graph, args, inputs, outputs, axes) in jobs.items():
        path = out_dir / f"{name}.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notices
            torch.onnx.export(graph, args, str(path), dynamo=False, opset_version=ONNX_OPSET, input_names=inputs,
                              output_names=outputs, dynamic_axes=axes, do_constant_folding=True)
        _set_metadata(path, flow_metadata(c), encoder=name == ENCODER_NAME)
        paths[name] = path
    return paths
