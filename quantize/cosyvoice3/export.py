"""ONNX export of the Fun-CosyVoice3 LLM and flow stages: the graph contract between the build host and the runtime.

Most of the contract is CosyVoice2's, because the computation is: the LLM graph is `cosyvoice2.llm_export`'s
(the same Qwen2 causal pass with explicit KV caches, speech logits only), the flow graphs are built from
`cosyvoice2.flow_export`'s wrappers (the v3 flow keeps the `encode` / `velocity` signatures). What differs:

LLM (`llm.onnx`: one graph for prefill and decode; signature in `cosyvoice2.llm_export`)
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

from pathlib import Path

import numpy as np

from cosyedge.quantize.cosyvoice2.flow import N_TIMESTEPS
from cosyedge.quantize.cosyvoice2.flow_export import ENCODER_NAME, ESTIMATOR_NAME, export_flow_graphs
from cosyedge.quantize.cosyvoice2.llm_export import LLM_NAME, export_llm as _export_llm_graphs
from cosyedge.quantize.cosyvoice3.flow import CausalMaskedDiffWithDiT, Flow3Config
from cosyedge.quantize.cosyvoice3.llm import CosyVoice3LM

__all__ = ["ENCODER_NAME", "ESTIMATOR_NAME", "LLM_NAME", "embedding_tables", "export_flow", "export_llm",
           "flow_metadata", "llm_metadata"]


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


def export_llm(module: CosyVoice3LM, out_dir: Path) -> dict[str, Path]:
    """Write llm.onnx (CosyVoice2's graph over the v3 module) with v3 metadata."""
    return _export_llm_graphs(module, Path(out_dir), llm_metadata(module))  # type: ignore[arg-type]


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

    CosyVoice2's flow export (`export_flow_graphs`, which also restores the `streaming` input the v3 encoder does
    not use); the example length (2 x 37 = 74 frames) crosses a 50-frame chunk boundary and no example size
    equals another, so no dynamic dimension is specialised.
    """
    return export_flow_graphs(module, out_dir, flow_metadata(module.config), frames=2 * 37)
