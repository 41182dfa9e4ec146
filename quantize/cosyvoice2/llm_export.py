"""ONNX export of the CosyVoice2 LLM stage: the graph contract between the build host and the runtime.

One graph traces the one causal pass `Qwen2LM.forward` over n new positions after a cache of P >= 0 positions, so
the prefill (P = 0, zero-size cache arrays) and every decode step (n = 1) run the same file and the same weights
(one copy in memory, not one per call kind). The decoding loop, the eos rule and the cache between calls belong
to the runtime.

ONNX graph written by `export_llm` (opset 17, standard ops only, float32; the embedding tables are NOT inside:
the runtime gathers rows from `embedding_tables()` with numpy and feeds embeddings). Symbols: B batch, n new
positions, P cached positions (0 for the prefill), H hidden size, NL layers, KV key/value heads, D head dim,
V speech vocabulary.

`llm.onnx`
  inputs   inputs_embeds   float32 [B, n, H]   prefill: the lm_input (padded rows may hold anything, e.g. zeros);
                                               decode: speech_embedding[previous token] (n = 1)
           past_key        float32 [NL, B, KV, P, D]   present_key of the previous call; P = 0 for the prefill
           past_value      float32 [NL, B, KV, P, D]
           attention_mask  int64   [B, P + n]  1 = real position, 0 = padding (cached slots first, then the new)
           position_ids    int64   [B, n]      RoPE positions of the new inputs: prefill cumsum(mask) - 1 clamped at
                                               0 (left padding starts each row at 0); decode the row's real count
  outputs  logits          float32 [B, V]      raw `llm_decoder` output (no log_softmax) at the LAST new position
                                               whose mask is 1 in each row
           present_key     float32 [NL, B, KV, P + n, D]   RoPE already applied; one slot per position
           present_value   float32 [NL, B, KV, P + n, D]

Greedy decoding with the graph (batch 1, no padding): call with the lm_input [1, L, H], empty caches
[NL, 1, KV, 0, D], mask ones(L), positions 0..L-1; then for step i = 0, 1, ...: logits -> eos -inf if
i < min_len -> argmax -> stop if in the stop set or i == max_len, else feed that token's speech_embedding row
with the returned caches, position_ids = L + i and mask ones(L + i + 1).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from cosyedge.quantize.cosyvoice2.llm import Qwen2LM
from cosyedge.quantize.cosyvoice2.onnx_export import trace_to_onnx

LLM_NAME = "llm.onnx"


def embedding_tables(module: Qwen2LM) -> dict[str, np.ndarray]:
    """float32 tables the runtime gathers from: embed_tokens [text vocab, H], speech_embedding [V, H],
    llm_embedding [2, H] (row 0 sos, row 1 task_id)."""
    return {
        "embed_tokens": module.body.embed_tokens.weight.detach().cpu().numpy().astype(np.float32),
        "speech_embedding": module.speech_embedding.weight.detach().cpu().numpy().astype(np.float32),
        "llm_embedding": module.llm_embedding.weight.detach().cpu().numpy().astype(np.float32),
    }


class LLMGraph(nn.Module):
    """Export wrapper: (inputs_embeds, past_key, past_value, attention_mask, position_ids) -> (logits, present_*)."""

    def __init__(self, lm: Qwen2LM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, inputs_embeds: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor,
                attention_mask: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.lm.forward(inputs_embeds, attention_mask, position_ids, past_key, past_value)


def export_llm(module: Qwen2LM, out_dir: Path, metadata: dict[str, str] | None = None) -> dict[str, Path]:
    """Write llm.onnx (signature in the module docstring) into out_dir, with `metadata` in its metadata_props
    when given (CosyVoice3's stop ids).

    Traced with the TorchScript exporter (no onnxscript needed); example shapes use B = 2 and distinct n and P
    so that no dynamic dimension is specialised (tests check that P = 0 and n = 1 run).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    module = module.eval()
    c = module.config.qwen
    b, n, p = 2, 5, 3
    embeds = torch.randn(b, n, c.hidden_size)
    cache = torch.randn(c.num_layers, b, c.num_kv_heads, p, c.head_dim)
    mask = torch.ones(b, p + n, dtype=torch.int64)
    positions = torch.arange(p, p + n, dtype=torch.int64).expand(b, n)
    cache_axes = {1: "batch", 3: "past"}
    present_axes = {1: "batch", 3: "total"}
    axes = {"inputs_embeds": {0: "batch", 1: "length"}, "past_key": cache_axes, "past_value": cache_axes,
            "attention_mask": {0: "batch", 1: "total"}, "position_ids": {0: "batch", 1: "length"},
            "logits": {0: "batch"}, "present_key": present_axes, "present_value": present_axes}
    inputs = ["inputs_embeds", "past_key", "past_value", "attention_mask", "position_ids"]
    path = trace_to_onnx(LLMGraph(module), (embeds, cache, cache.clone(), mask, positions), out_dir / LLM_NAME,
                         inputs, ["logits", "present_key", "present_value"], axes, metadata)
    return {"llm": path}
