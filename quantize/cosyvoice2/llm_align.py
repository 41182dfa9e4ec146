"""The word-timing pass of the CosyVoice LLM (both families): the `llm_align` graph and how a bundle gets it.

What it is: the first layers of the LLM (through the deepest chosen one) run teacher-forced over [sos; prompt text;
text; task id; prompt speech; generated speech tokens] and return, for every position, the attention weights of
the chosen layers (mean over their heads and over the chosen layers) on the target text tokens. The runtime
aligns speech tokens to text tokens to words with those (device/cosyvoice2/alignment.py).

Why a graph of its own and not an output of `llm.onnx`: the decode graph is rewritten for speed (cv2speed's
GroupQueryAttention on the cpu targets, TensorRT's fused kernels), and fused attention never materialises the
weights; an extra output would also be computed (or copied) at every decode step of every request, whether or
not anyone wants words. The pass stops after the deepest chosen layer and has no speech head, so it costs a
bounded share (depth / layers) of one prefill over the segment, and its session is created only when words are
first asked for. It takes a key/value cache as `llm.onnx` does, so a stream aligns each chunk's new tokens only.

`llm_align.onnx` (opset 17, batch 1; T = target text tokens, K = `depth` layers, other symbols as llm_export.py)
  inputs   inputs_embeds   float32 [1, n, H]          the new positions' embeddings
           past_key        float32 [K, 1, KV, P, D]   present_key of the previous call (P = 0 on the first)
           past_value      float32 [K, 1, KV, P, D]
           attention_mask  int64   [1, P + n]         ones (causal attention over every earlier position)
           position_ids    int64   [1, n]             P, P + 1, ...
           text_positions  int64   [T]                positions of the target text tokens in the sequence
  outputs  attention       float32 [n, T]             mean attention weight of each new position on each text token
           present_key     float32 [K, 1, KV, P + n, D]
           present_value   float32 [K, 1, KV, P + n, D]

Which layers: the ones whose attention is most monotonic from a voice's prompt speech tokens onto its prompt
transcript (the release's own paired speech and text), scored by the best monotonic path's mean log weight, among
the first half of the layers (the cost bound); `ALIGN_LAYERS` of them. A release without a zero-shot voice gets
the layers just below that bound. With random weights the choice, like the attention, means nothing.

Precision: every target's pass has MatMulNBits 8-bit weights (blocks of 128; one row per call) and runs on the CPU
provider, as CAM++ and the speech tokenizer do (no TensorRT profile, nothing in a GPU's memory plan); it is gated
against fp32 on a prompt: the alignment paths must agree (`ALIGN_AGREEMENT` of the speech tokens within one text
token), else every target keeps the fp32 pass and the manifest says so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from cosyedge.device.cosyvoice2.alignment import monotonic_path
from cosyedge.quantize.cosyvoice2.gates import session
from cosyedge.quantize.cosyvoice2.llm import Qwen2LM
from cosyedge.quantize.cosyvoice2.onnx_export import trace_to_onnx
from cosyedge.quantize.cosyvoice2.precision_transforms import nbits_weights

ALIGN_NAME = "llm_align"
ALIGN_LAYERS = 4          # layers whose attention is averaged
DEPTH_SHARE = 0.5         # the pass runs at most this share of the layers
ALIGN_AGREEMENT = 0.9     # share of speech tokens whose quantized path is within one text token of fp32's
ALIGN_PRECISION = "int8"  # MatMulNBits weights, on the CPU provider for every target


def layer_attention(lm: Qwen2LM, inputs_embeds: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor,
                    attention_mask: torch.Tensor, position_ids: torch.Tensor, depth: int
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The first `depth` layers of `lm`'s causal pass: each layer's attention weights (mean over heads, [1, n,
    P + n]) and its keys and values."""
    allowed, cos, sin = lm.frame(inputs_embeds, attention_mask, position_ids)
    x = inputs_embeds
    maps, keys, values = [], [], []
    for index in range(depth):
        x, k, v, weights = lm.body.layers[index].attend(x, cos, sin, allowed, past_key[index], past_value[index])
        maps.append(weights.mean(dim=(1, 2)))
        keys.append(k)
        values.append(v)
    return maps, keys, values


class AlignmentPass(nn.Module):
    """The `llm_align` graph (module docstring) of `lm` over `layers`."""

    def __init__(self, lm: Qwen2LM, layers: Sequence[int]) -> None:
        super().__init__()
        self.lm = lm
        self.layers = tuple(sorted(set(int(i) for i in layers)))
        self.depth = self.layers[-1] + 1

    def forward(self, inputs_embeds: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor,
                attention_mask: torch.Tensor, position_ids: torch.Tensor, text_positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        maps, keys, values = layer_attention(self.lm, inputs_embeds, past_key, past_value, attention_mask,
                                             position_ids, self.depth)
        chosen = torch.stack([maps[i] for i in self.layers]).mean(dim=0)[0]        # [n, P + n]
        c = self.lm.config.qwen
        shape = (self.depth, 1, c.num_kv_heads, attention_mask.shape[1], c.head_dim)
        return (chosen.index_select(1, text_positions), torch.stack(keys).reshape(shape),
                torch.stack(values).reshape(shape))


@dataclass(frozen=True)
class Prompt:
    """A voice's paired transcript and speech tokens: what the layer choice and the precision gate look at."""
    text_ids: tuple[int, ...]
    speech: tuple[int, ...]


def prompt_sequence(lm: Qwen2LM, prompt: Prompt) -> tuple[torch.Tensor, np.ndarray, slice]:
    """The teacher-forced sequence of a prompt read as text + speech: embeddings [1, L, H], the transcript's
    positions, and the rows that choose each speech token (the position before it)."""
    embeds = lm.lm_input((), prompt.text_ids, prompt.speech)
    first = 1 + len(prompt.text_ids)  # the task id's position: it chooses the first speech token
    return embeds, np.arange(1, first, dtype=np.int64), slice(first, first + len(prompt.speech))


def path_score(attention: np.ndarray) -> float:
    """Mean log weight on the best monotonic path (rows normalised): 0 for one sharp diagonal, log(1/T) for none."""
    weights = attention / np.maximum(attention.sum(axis=1, keepdims=True), 1e-9)
    path = monotonic_path(weights)
    return float(np.mean(np.log(np.maximum(weights[np.arange(len(path)), path], 1e-9))))


@torch.no_grad()
def choose_layers(lm: Qwen2LM, prompts: Sequence[Prompt]) -> tuple[tuple[int, ...], str]:
    """The `ALIGN_LAYERS` layers (within the first `DEPTH_SHARE`) whose prompt attention is most monotonic, and how
    they were chosen."""
    layers = lm.config.qwen.num_layers
    cap = max(1, math.ceil(layers * DEPTH_SHARE))
    count = min(ALIGN_LAYERS, cap)
    usable = [p for p in prompts if len(p.text_ids) >= 2 and len(p.speech) >= 2]
    if not usable:
        return tuple(range(cap - count, cap)), "default"
    scores = np.zeros(cap)
    for prompt in usable:
        embeds, text, rows = prompt_sequence(lm, prompt)
        maps, _, _ = _full_pass(lm, embeds, cap)
        for index, weights in enumerate(maps):
            scores[index] += path_score(weights[0].numpy()[rows][:, text])
    best = np.argsort(-scores, kind="stable")[:count]
    return tuple(sorted(int(i) for i in best)), "prompt attention"


def _full_pass(lm: Qwen2LM, embeds: torch.Tensor, depth: int):
    c = lm.config.qwen
    empty = torch.zeros(c.num_layers, 1, c.num_kv_heads, 0, c.head_dim)
    length = embeds.shape[1]
    return layer_attention(lm, embeds, empty, empty, torch.ones(1, length, dtype=torch.int64),
                           torch.arange(length, dtype=torch.int64)[None], depth)


def export_align(module: AlignmentPass, path: Path) -> Path:
    """Write the graph (module docstring); example shapes with distinct n, P and T, so no axis is specialised."""
    c = module.lm.config.qwen
    n, p, t = 5, 3, 4
    embeds = torch.randn(1, n, c.hidden_size)
    cache = torch.randn(module.depth, 1, c.num_kv_heads, p, c.head_dim)
    mask = torch.ones(1, p + n, dtype=torch.int64)
    positions = torch.arange(p, p + n, dtype=torch.int64)[None]
    text = torch.arange(1, 1 + t, dtype=torch.int64)
    cache_axes, present_axes = {3: "past"}, {3: "total"}
    axes = {"inputs_embeds": {1: "length"}, "past_key": cache_axes, "past_value": cache_axes,
            "attention_mask": {1: "total"}, "position_ids": {1: "length"}, "text_positions": {0: "text"},
            "attention": {0: "length", 1: "text"}, "present_key": present_axes, "present_value": present_axes}
    return trace_to_onnx(module.eval(), (embeds, cache, cache.clone(), mask, positions, text), path,
                         ["inputs_embeds", "past_key", "past_value", "attention_mask", "position_ids",
                          "text_positions"], ["attention", "present_key", "present_value"], axes)


@dataclass(frozen=True)
class AlignExport:
    """What the bundle writer keeps of the pass while the torch module is gone: its fp32 graph, the layers, and
    the gate's input (a prompt's sequence, its transcript positions and speech rows)."""
    fp32: Path
    layers: tuple[int, ...]
    selected_by: str
    feeds: dict[str, np.ndarray]
    rows: slice

    @property
    def config(self) -> dict[str, Any]:
        """manifest.config["align"]."""
        return {"layers": list(self.layers), "depth": self.layers[-1] + 1, "selected_by": self.selected_by}


@torch.no_grad()
def export_alignment(lm: Qwen2LM, work: Path, prompts: Sequence[Prompt]) -> AlignExport:
    """Choose the layers, export the fp32 pass into `work` and keep a gate input (the first usable prompt, else a
    sequence of random speech tokens after the sos)."""
    layers, selected_by = choose_layers(lm, prompts)
    module = AlignmentPass(lm, layers)
    path = export_align(module, work / f"{ALIGN_NAME}.fp32.onnx")
    usable = [p for p in prompts if len(p.text_ids) >= 2 and len(p.speech) >= 2]
    prompt = usable[0] if usable else Prompt(tuple(range(100, 112)), tuple(range(0, 6000, 150)))
    embeds, text, rows = prompt_sequence(lm, prompt)
    c = lm.config.qwen
    empty = np.zeros((module.depth, 1, c.num_kv_heads, 0, c.head_dim), np.float32)
    length = embeds.shape[1]
    feeds = {"inputs_embeds": embeds.numpy().astype(np.float32), "past_key": empty, "past_value": empty,
             "attention_mask": np.ones((1, length), np.int64), "position_ids": np.arange(length)[None],
             "text_positions": text}
    return AlignExport(path, layers, selected_by, feeds, rows)


def _paths_agree(export: AlignExport, graph: Path) -> dict[str, float]:
    """The gate's metrics of one quantized pass against fp32 on the export's prompt."""
    reference, quantized = (session(p).run(["attention"], export.feeds)[0][export.rows] for p in (export.fp32, graph))
    ref_path, q_path = monotonic_path(reference), monotonic_path(quantized)
    return {"path_agreement": round(float(np.mean(np.abs(ref_path - q_path) <= 1)), 4),
            "max_abs_weight": round(float(np.abs(reference - quantized).max()), 6)}


def alignment_targets(export: AlignExport, targets: dict[str, dict], add_component: Callable[[str, str, str], None],
                      log: Callable[[str], None] = lambda _: None) -> dict[str, dict]:
    """The pass of the built targets: its int8 graph written once, gated against fp32, named in every
    `targets[t]["graphs"]` (a miss keeps fp32). Returns manifest.quality["alignment"]."""
    if not targets:
        return {}
    dst = export.fp32.with_name(f"{ALIGN_NAME}.{ALIGN_PRECISION}.onnx")
    nbits_weights(export.fp32, dst, (), bits=8)
    metrics = _paths_agree(export, dst)
    passed = metrics["path_agreement"] >= ALIGN_AGREEMENT
    if passed:
        add_component(ALIGN_NAME, ALIGN_PRECISION, dst.name)
    else:
        dst.unlink()
    chosen = ALIGN_PRECISION if passed else "fp32"
    log(f"word-timing pass {chosen} (path agreement {metrics['path_agreement']:.3f})")
    quality = {}
    for target, entry in targets.items():
        entry["graphs"][ALIGN_NAME] = {"component": ALIGN_NAME, "precision": chosen}
        quality[target] = {"precision": chosen, "tried": ALIGN_PRECISION, "passed": passed, "metrics": metrics,
                           "thresholds": {"path_agreement": ALIGN_AGREEMENT}}
    return quality


def voice_prompts(voice_files: Sequence[Path]) -> list[Prompt]:
    """The zero-shot voices' transcripts and speech tokens (bundle voice files written by `write_voices`)."""
    prompts = []
    for path in voice_files:
        with np.load(path) as voice:
            if "llm_prompt_speech_token" in voice.files:
                prompts.append(Prompt(tuple(int(i) for i in voice["prompt_text_ids"]),
                                      tuple(int(i) for i in voice["llm_prompt_speech_token"])))
    return prompts
