"""The `llm` graph with a shared key/value cache: each layer's attention becomes ONNX Runtime's GroupQueryAttention
writing the new positions into a preallocated cache buffer in place (the CPU targets' LLM graphs).

Why: the exported graph (llm_export.py) takes the cache stacked over layers [NL, B, KV, P, D] and returns it one
position longer, so every decode step gathers each layer's slice, concatenates the new position and stacks all
layers again: three copies of the whole cache per token, plus ~40 small nodes per layer (rotary, grouping reshapes,
mask, softmax) whose per-node overhead rivals the weight products of a 4-bit model. GroupQueryAttention does
rotary, grouped attention and the cache write in one kernel per layer, and with past and present bound to the same
buffer (the runtime's IO binding) nothing is copied.

Contract of the rewritten graph (everything else as llm_export.py; the fp32 export keeps its own contract):

  inputs   inputs_embeds          float32 [B, n, H]
           position_ids           int64   [B, n]    RoPE positions of the new inputs (any valid value on padding)
           seqlens_k              int32   [B]       per row: real positions after this call - 1
           total_sequence_length  int32   []        max over rows of real positions after this call
           last_index             int64   [B]       per row: index in n of the last real new position
           past_key_<i>, past_value_<i>   float32 [B, KV, C, D] per layer i: the cache buffer, C >= every row's
                                          positions after this call; row r's positions fill slots 0..len_r - 1
  outputs  logits                 float32 [B, V]    at last_index
           present_key_<i>, present_value_<i>  float32 [B, KV, C, D]: the same buffer when bound to it

A prefill is the call with n = the longest prompt, rows right-padded, seqlens_k = length - 1 and
total_sequence_length = n (the kernel's first-prompt case); a decode step n = 1. ORT's CPU kernel accepts n > 1
after a cache only for batch 1. Rotary tables (`MAX_POSITIONS` rows, computed as the export computes its angles:
float32 position x float32 inverse frequency) are initializers; metadata `kv_cache` = `shared`, `max_positions`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cosyedge.quantize.cosyvoice2.graph_index import GraphIndex, finish, heads, prune, scaled, topological

MS_DOMAIN = "com.microsoft"
MAX_POSITIONS = 16384     # rotary table rows: prompt + generated speech tokens of one segment stay far below
SHARED_INPUTS = ("seqlens_k", "total_sequence_length", "last_index")


@dataclass
class _Layer:
    index: int
    q: str
    k: str
    v: str
    out: str
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    inv_freq: np.ndarray


def _rotated(g: GraphIndex, name: str) -> tuple[str, str] | None:
    """(x before rotary, the cos tensor) if `name` = x * cos + rotate_half(x) * sin."""
    add = g.node(name, "Add")
    if add is None:
        return None
    for term in add.input:
        mul = g.node(term, "Mul")
        if mul is None:
            continue
        for i in (0, 1):
            cos = g.node(mul.input[1 - i], "Cos")
            if cos is not None and g.node(mul.input[i], "Transpose") is not None:
                return mul.input[i], mul.input[1 - i]
    return None


def _cached(g: GraphIndex, name: str, cache: str) -> tuple[int, str] | None:
    """(layer, new part) if `name` = Concat(Gather(cache, layer), new, axis=2)."""
    concat = g.node(name, "Concat")
    if concat is None or len(concat.input) != 2 or g.attr(concat, "axis") != 2:
        return None
    gather = g.node(concat.input[0], "Gather")
    if gather is None or gather.input[0] != cache:
        return None
    return int(g.value(gather.input[1]).reshape(-1)[0]), concat.input[1]


def _inverse_frequency(g: GraphIndex, cos: str) -> np.ndarray | None:
    """The constant [D/2] factor of position_ids in the graph's rotary angles feeding Cos."""
    seen, todo = set(), [g.producer[cos].input[0]]
    while todo:
        name = todo.pop()
        node = g.producer.get(name)
        if node is None or name in seen:
            continue
        seen.add(name)
        if node.op_type == "Mul":
            for i in (0, 1):
                value = g.value(node.input[i])
                if value is not None and value.dtype != object and value.size > 1:
                    return value.reshape(-1).astype(np.float32)
        todo.extend(node.input)
    return None


def _match(g: GraphIndex, softmax: onnx.NodeProto) -> _Layer | None:
    where = g.node(softmax.input[0], "Where")
    if where is None:
        return None
    scores, scale = scaled(g, where.input[1])
    qk = g.node(scores, "MatMul")
    users = g.consumers.get(softmax.output[0], [])
    if qk is None or len(users) != 1 or users[0].op_type != "MatMul":
        return None
    grouped = g.node(qk.input[0], "Reshape")                 # q [B, H, n, D] -> [B, KV, G, n, D]
    keys = g.node(qk.input[1], "Transpose")                  # Unsqueeze(K [B, KV, T, D]) transposed
    values = g.node(users[0].input[1], "Unsqueeze")
    if grouped is None or keys is None or g.node(keys.input[0], "Unsqueeze") is None or values is None:
        return None
    q_rot, k_cat = grouped.input[0], g.producer[keys.input[0]].input[0]
    k_part, v_part = _cached(g, k_cat, "past_key"), _cached(g, values.input[0], "past_value")
    q_pre, k_pre = _rotated(g, q_rot), _rotated(g, k_part[1]) if k_part else None
    if None in (k_part, v_part, q_pre, k_pre) or k_part[0] != v_part[0]:
        return None
    q, k, v = (heads(g, x, (0, 2, 1, 3)) for x in (q_pre[0], k_pre[0], v_part[1]))
    merge = [g.consumers.get(users[0].output[0], [])]        # [B, KV, G, n, D] -> Reshape -> Transpose -> Reshape
    for op in ("Reshape", "Transpose", "Reshape"):
        if len(merge[-1]) != 1 or merge[-1][0].op_type != op:
            return None
        merge.append(g.consumers.get(merge[-1][0].output[0], []))
    inv_freq = _inverse_frequency(g, q_pre[1])
    if None in (q, k, v) or inv_freq is None or k[1:] != v[1:] or q[2] != k[2]:
        return None
    return _Layer(k_part[0], q[0], k[0], v[0], merge[-2][0].output[0], q[1], k[1], q[2], scale, inv_freq)


def _rotary_tables(inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(MAX_POSITIONS, dtype=np.float32)[:, None] * inv_freq[None, :]   # float32, as the export
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def supports_shared_kv(src: Path) -> bool:
    """Whether ONNX Runtime's CPU GroupQueryAttention can run the graph's attention: its rotary kernel needs a head
    size that is a multiple of 16 (CosyVoice2-0.5B: 64; the golden tiny release's 8 keeps the stacked graph)."""
    model = onnx.load(str(src), load_external_data=False)
    shape = next(i.type.tensor_type.shape for i in model.graph.input if i.name == "past_key")
    return shape.dim[4].dim_value % 16 == 0


def shared_kv_llm(src: Path | onnx.ModelProto, dst: Path | None = None) -> onnx.ModelProto:
    """Rewrite the exported `llm` graph `src` into the shared-cache contract (module docstring); every layer must
    match, or ValueError names what did not."""
    model = onnx.load(str(src)) if not isinstance(src, onnx.ModelProto) else src
    g = GraphIndex(model)
    layers = sorted((m for m in (_match(g, n) for n in g.graph.node if n.op_type == "Softmax") if m is not None),
                    key=lambda layer: layer.index)
    shape = g.shapes.get("past_key")
    if not layers or shape is None or [layer.index for layer in layers] != list(range(shape[0])):
        raise ValueError(f"llm graph: {len(layers)} attention layers matched, the cache holds "
                         f"{shape[0] if shape else '?'}")
    argmax = [n for n in g.graph.node if n.op_type == "ArgMax"]
    if len(argmax) != 1:
        raise ValueError("llm graph: expected one ArgMax picking the last real position")
    first = layers[0]
    if any(not np.array_equal(layer.inv_freq, first.inv_freq) for layer in layers):
        raise ValueError("llm graph: layers use different rotary frequencies")
    cos, sin = _rotary_tables(first.inv_freq)
    graph = g.graph
    graph.initializer.extend([numpy_helper.from_array(cos, "rotary_cos"), numpy_helper.from_array(sin, "rotary_sin")])
    fused = {layer.out: helper.make_node(
        "GroupQueryAttention",
        [layer.q, layer.k, layer.v, f"past_key_{layer.index}", f"past_value_{layer.index}", "seqlens_k",
         "total_sequence_length", "rotary_cos", "rotary_sin", "position_ids"],
        [layer.out, f"present_key_{layer.index}", f"present_value_{layer.index}"],
        name=f"/layers.{layer.index}/GroupQueryAttention", domain=MS_DOMAIN, num_heads=layer.heads,
        kv_num_heads=layer.kv_heads, scale=layer.scale, do_rotary=1, rotary_interleaved=0) for layer in layers}
    nodes = []
    for node in graph.node:
        hit = next((o for o in node.output if o in fused), None)
        if hit is not None:
            nodes.append(fused[hit])
        elif node is argmax[0]:
            continue
        else:
            node.input[:] = ["last_index" if i == argmax[0].output[0] else i for i in node.input]
            nodes.append(node)
    cache = ["batch", first.kv_heads, "capacity", first.head_dim]
    inputs = [i for i in graph.input if i.name in ("inputs_embeds", "position_ids")]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
               helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
               helper.make_tensor_value_info("last_index", TensorProto.INT64, ["batch"])]
    outputs = [o for o in graph.output if o.name == "logits"]
    for layer in layers:
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}_{layer.index}", TensorProto.FLOAT, cache))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}_{layer.index}", TensorProto.FLOAT, cache))
    for field, values in ((graph.input, inputs), (graph.output, outputs)):
        kept = list(values)
        del field[:]
        field.extend(kept)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    prune(graph)
    stale = {"attention_mask", "past_key", "past_value"} & {i for n in graph.node for i in n.input}
    if stale:
        raise ValueError(f"llm graph: {sorted(stale)} still read after the rewrite")
    nodes = list(graph.node)
    topological(nodes, g)
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    props = {p.key: p.value for p in model.metadata_props} | {"kv_cache": "shared",
                                                             "max_positions": str(MAX_POSITIONS)}
    helper.set_model_props(model, props)
    return finish(model, dst)
