"""ONNX export of the CosyVoice2 LLM stage: the graph contract between the build host and the runtime.

Both graphs trace the one causal pass `Qwen2LM.forward`, so prefill and decode compute the same function as the
torch module the goldens check; the decoding loop, the eos rule and the cache between calls belong to the runtime.

ONNX graphs written by `export_llm` (opset 17, standard ops only, float32; the embedding tables are NOT inside:
the runtime gathers rows from `embedding_tables()` with numpy and feeds embeddings). Symbols: B batch, L prompt
length, P cached length, H hidden size, NL layers, KV key/value heads, D head dim, V speech vocabulary.

`llm_prefill.onnx`
  inputs   inputs_embeds   float32 [B, L, H]   the lm_input (padded rows may hold anything, e.g. zeros)
           attention_mask  int64   [B, L]      1 = real position, 0 = padding; right or left padding both work
  outputs  logits          float32 [B, V]      raw `llm_decoder` output (no log_softmax) at the LAST position whose
                                               mask is 1 in each row
           present_key     float32 [NL, B, KV, L, D]   RoPE already applied; one slot per input position
           present_value   float32 [NL, B, KV, L, D]
  Positions are cumsum(attention_mask) - 1 (so a left-padded row starts at 0 on its first real position).

`llm_decode.onnx`
  inputs   inputs_embeds   float32 [B, 1, H]   speech_embedding[previous token]
           past_key        float32 [NL, B, KV, P, D]   present_key of the previous call
           past_value      float32 [NL, B, KV, P, D]
           attention_mask  int64   [B, P + 1]  the mask of every cached slot, then 1 for the new position
           position_ids    int64   [B, 1]      number of real positions already in the cache for that row
  outputs  logits          float32 [B, V]
           present_key     float32 [NL, B, KV, P + 1, D]
           present_value   float32 [NL, B, KV, P + 1, D]

Greedy decoding with the graphs (batch 1, no padding): prefill with mask ones; then for step i = 0, 1, ...:
logits -> eos -inf if i < min_len -> argmax -> stop if in the stop set or i == max_len, else feed that token's
speech_embedding row with position_ids = L + i and mask ones(L + i + 1).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from cosyedge.quantize.cosyvoice2.llm import Qwen2LM
from cosyedge.quantize.cosyvoice2.onnx_export import trace_to_onnx

PREFILL_NAME = "llm_prefill.onnx"
DECODE_NAME = "llm_decode.onnx"


def embedding_tables(module: Qwen2LM) -> dict[str, np.ndarray]:
    """float32 tables the runtime gathers from: embed_tokens [text vocab, H], speech_embedding [V, H],
    llm_embedding [2, H] (row 0 sos, row 1 task_id)."""
    return {
        "embed_tokens": module.body.embed_tokens.weight.detach().cpu().numpy().astype(np.float32),
        "speech_embedding": module.speech_embedding.weight.detach().cpu().numpy().astype(np.float32),
        "llm_embedding": module.llm_embedding.weight.detach().cpu().numpy().astype(np.float32),
    }


class PrefillGraph(nn.Module):
    """Export wrapper: (inputs_embeds, attention_mask) -> (logits, present_key, present_value)."""

    def __init__(self, lm: Qwen2LM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.lm.prefill(inputs_embeds, attention_mask)


class DecodeGraph(nn.Module):
    """Export wrapper: (inputs_embeds, past_key, past_value, attention_mask, position_ids) -> (logits, present_*)."""

    def __init__(self, lm: Qwen2LM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, inputs_embeds: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor,
                attention_mask: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.lm.forward(inputs_embeds, attention_mask, position_ids, past_key, past_value)


def export_llm(module: Qwen2LM, out_dir: Path, metadata: dict[str, str] | None = None) -> dict[str, Path]:
    """Write llm_prefill.onnx and llm_decode.onnx (signatures in the module docstring) into out_dir, with
    `metadata` in both files' metadata_props when given (CosyVoice3's stop ids).

    Traced with the TorchScript exporter (no onnxscript needed); example shapes use B = 2 and distinct
    lengths so that no dynamic dimension is specialised. Each graph carries its own copy of the weights.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    module = module.eval()
    c = module.config.qwen
    b, n, p = 2, 5, 3
    embeds = torch.randn(b, n, c.hidden_size)
    mask = torch.ones(b, n, dtype=torch.int64)
    cache = torch.randn(c.num_layers, b, c.num_kv_heads, p, c.head_dim)
    cache_axes = {1: "batch", 3: "past"}
    present_axes = {1: "batch", 3: "total"}
    jobs = {
        "llm_prefill": (
            PrefillGraph(module), (embeds, mask), ["inputs_embeds", "attention_mask"],
            {"inputs_embeds": {0: "batch", 1: "length"}, "attention_mask": {0: "batch", 1: "length"},
             "logits": {0: "batch"}, "present_key": present_axes, "present_value": present_axes}),
        "llm_decode": (
            DecodeGraph(module),
            (embeds[:, :1], cache, cache.clone(), torch.ones(b, p + 1, dtype=torch.int64),
             torch.full((b, 1), p, dtype=torch.int64)),
            ["inputs_embeds", "past_key", "past_value", "attention_mask", "position_ids"],
            {"inputs_embeds": {0: "batch"}, "past_key": cache_axes, "past_value": cache_axes,
             "attention_mask": {0: "batch", 1: "total"}, "position_ids": {0: "batch"},
             "logits": {0: "batch"}, "present_key": present_axes, "present_value": present_axes}),
    }
    outputs = ["logits", "present_key", "present_value"]
    return {name: trace_to_onnx(graph, args, out_dir / f"{name}.onnx", inputs, outputs, axes, metadata)
            for name, (graph, args, inputs, axes) in jobs.items()}
