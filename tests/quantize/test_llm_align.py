"""The word-timing pass (`llm_align`, quantize/cosyvoice2/llm_align.py): the exported graph equals the torch
module, the module's weights are the LLM's own attention, the cache gives the rows a whole pass gives, and the
quantized cpu pass is gated against fp32."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from cosyedge.quantize.cosyvoice2.llm import Qwen2LM, build_llm
from cosyedge.quantize.cosyvoice2.llm_align import (ALIGN_NAME, AlignmentPass, Prompt, alignment_targets,
                                                    choose_layers, export_alignment)
from cosyedge.quantize.cosyvoice2.llm_qwen2 import _rotate_half
from cosyedge.quantize.cosyvoice2.release import Release

ATOL = 1e-5


@pytest.fixture(scope="module")
def lm(release: Release) -> Qwen2LM:
    return build_llm(release)


@pytest.fixture(scope="module")
def sequence(lm: Qwen2LM) -> dict[str, np.ndarray]:
    """A zero-shot-like sequence: 7 prompt text ids, 9 target text ids, 12 prompt speech tokens, 20 speech tokens."""
    rng = np.random.default_rng(0)
    embeds = lm.lm_input(rng.integers(0, 5000, 9), rng.integers(0, 5000, 7), rng.integers(0, 6561, 12))
    speech = lm.speech_embedding(torch.as_tensor(rng.integers(0, 6561, 20)))[None]
    return {"embeds": torch.cat([embeds, speech], dim=1).detach().numpy(), "text": np.arange(8, 17)}


def feeds(module: AlignmentPass, embeds: np.ndarray, text: np.ndarray, past=None) -> dict[str, np.ndarray]:
    c = module.lm.config.qwen
    empty = np.zeros((module.depth, 1, c.num_kv_heads, 0, c.head_dim), np.float32)
    key, value = past if past is not None else (empty, empty)
    start, length = key.shape[3], embeds.shape[1]
    return {"inputs_embeds": embeds.astype(np.float32), "past_key": key, "past_value": value,
            "attention_mask": np.ones((1, start + length), np.int64),
            "position_ids": np.arange(start, start + length)[None], "text_positions": text}


@torch.no_grad()
def oracle(lm: Qwen2LM, embeds: np.ndarray, text: np.ndarray, layers: tuple[int, ...]) -> np.ndarray:
    """The attention weights rebuilt by hand from the LLM's own prefill: each chosen layer's input (a hook),
    its query projection and rotary, the prefill's cached keys, a causal softmax; mean over heads and layers."""
    c = lm.config.qwen
    inputs: dict[int, torch.Tensor] = {}
    hooks = [lm.body.layers[i].register_forward_pre_hook(lambda _, args, i=i: inputs.update({i: args[0]}))
             for i in layers]
    _, keys, _ = lm.prefill(torch.as_tensor(embeds))
    for hook in hooks:
        hook.remove()
    n = embeds.shape[1]
    angles = torch.arange(n, dtype=torch.float32)[:, None] * lm.inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    maps = []
    for i in layers:
        attn = lm.body.layers[i].self_attn
        q = attn.q_proj(lm.body.layers[i].input_layernorm(inputs[i]))[0].reshape(n, c.num_heads, c.head_dim)
        q = q * angles.cos()[:, None] + _rotate_half(q) * angles.sin()[:, None]
        k = keys[i, 0].repeat_interleave(c.num_heads // c.num_kv_heads, dim=0)      # [heads, n, D]
        scores = torch.einsum("nhd,hmd->hnm", q, k) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), -torch.inf)
        maps.append(torch.softmax(scores, dim=-1).mean(dim=0))
    return torch.stack(maps).mean(dim=0)[:, text].numpy()


def test_the_graph_equals_the_module_and_the_module_is_the_llms_attention(lm, sequence, tmp_path: Path) -> None:
    layers = (0, 1)
    module = AlignmentPass(lm, layers)
    export = export_alignment(lm, tmp_path, [])         # default layer choice, on the same module
    assert export.layers == choose_layers(lm, [])[0] and export.fp32.name == f"{ALIGN_NAME}.fp32.onnx"
    from cosyedge.quantize.cosyvoice2.llm_align import export_align
    path = export_align(module, tmp_path / "pass.onnx")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    graph = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    whole = feeds(module, sequence["embeds"], sequence["text"])
    onnx_attention, key, value = graph.run(None, whole)
    with torch.no_grad():
        torch_attention, torch_key, _ = module(*(torch.as_tensor(v) for v in whole.values()))
    np.testing.assert_allclose(onnx_attention, torch_attention.numpy(), atol=ATOL)
    np.testing.assert_allclose(key, torch_key.numpy(), atol=ATOL)
    np.testing.assert_allclose(onnx_attention, oracle(lm, sequence["embeds"], sequence["text"], layers), atol=ATOL)
    with torch.no_grad():  # the pass's keys are the LLM's own (its prefill cache), layer for layer
        _, prefill_key, _ = lm.prefill(torch.as_tensor(sequence["embeds"]))
    np.testing.assert_allclose(key, prefill_key[:module.depth].numpy(), atol=ATOL)
    # in two calls, the second after the first's cache: the same rows
    cut = 30
    first, key, value = graph.run(None, feeds(module, sequence["embeds"][:, :cut], sequence["text"]))
    second, _, _ = graph.run(None, feeds(module, sequence["embeds"][:, cut:], sequence["text"], (key, value)))
    np.testing.assert_allclose(np.concatenate([first, second]), onnx_attention, atol=ATOL)


def test_the_cpu_pass_is_int8_after_its_gate_and_named_in_the_target(lm, tmp_path: Path) -> None:
    prompt = Prompt(tuple(range(200, 214)), tuple(range(3, 6561, 97)))
    export = export_alignment(lm, tmp_path, [prompt])
    assert export.selected_by == "prompt attention" and export.config["depth"] == export.layers[-1] + 1
    added = []
    targets = {"cpu": {"graphs": {"llm": {"component": "llm", "precision": "int8"}}},
               "gpu-fp16": {"graphs": {}}}
    quality = alignment_targets(export, targets, lambda *c: added.append(c))
    assert added == [(ALIGN_NAME, "int8", f"{ALIGN_NAME}.int8.onnx")]   # one graph for every target (CPU provider)
    assert targets["gpu-fp16"]["graphs"][ALIGN_NAME] == {"component": ALIGN_NAME, "precision": "int8"}
    assert targets["cpu"]["graphs"][ALIGN_NAME] == {"component": ALIGN_NAME, "precision": "int8"}
    assert quality["cpu"]["passed"] and quality["cpu"]["metrics"]["path_agreement"] >= 0.9
    import onnx
    ops = {node.op_type for node in onnx.load(str(tmp_path / f"{ALIGN_NAME}.int8.onnx")).graph.node}
    assert "MatMulNBits" in ops


def test_the_runtime_reads_the_row_of_the_position_that_chose_each_token(lm, cv2_tiny_bundle: Path) -> None:
    """Speech token i's row is the attention of the position before it (the task id, or the last prompt speech
    token, for the first): the device pass over a tiny bundle segment equals those rows of the torch module."""
    from cosyedge.device.engine import Engine
    from cosyedge.device.sessions import SessionConfig
    engine = Engine.load(cv2_tiny_bundle, precision="fp32", warmup=False,
                         sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))
    pipeline, request = engine.pipeline, engine.options(voice=0, sampling="greedy", deterministic=True)
    segment = engine.segments("Hello there, my friend.", words=True)[0]
    tokens = pipeline.speech_tokens(segment, request)
    inputs = pipeline._mode_inputs(request)
    device = pipeline._segment_pass(segment, inputs, tokens).attention
    lm_input = lm.lm_input(segment.ids, inputs.prompt_text, inputs.prompt_speech)
    module = AlignmentPass(lm, engine.bundle.manifest.config["align"]["layers"])
    sequence = torch.cat([lm_input, lm.speech_embedding(torch.as_tensor(tokens))[None]], dim=1).detach().numpy()
    text = 1 + len(inputs.prompt_text) + np.arange(len(segment.ids))
    with torch.no_grad():
        rows = module(*(torch.as_tensor(v) for v in feeds(module, sequence, text).values()))[0].numpy()
    first = lm_input.shape[1] - 1
    np.testing.assert_allclose(device, rows[first:first + len(tokens)], atol=ATOL)
