"""Fused attention for ONNX Runtime CPU: the exported MatMul + Softmax + MatMul attention of a graph becomes one
`com.microsoft` MultiHeadAttention node per site (any family: CosyVoice2's estimator, CosyVoice3's DiT).

Why: ORT runs the exported form as FusedMatMul, Add (the mask bias), Softmax and MatMul over [B, H, S, T] score
tensors, four passes over memory per layer; MultiHeadAttention does scale, bias, softmax and both products in one
kernel per (batch, head), and with no bias at all it takes MLAS's flash-attention path (tiles kept in cache, the
score tensor never written). The CPU kernel's flash path is refused when any bias is given, so each site with a
bias becomes `If(bias == 0 everywhere, MHA(q, k, v), MHA(q, k, v, bias))`: one condition per distinct bias
tensor, computed once per call. A non-streaming request of one utterance (full attention, every frame real) then
runs the flash path; padded batches and chunk-causal streaming calls run the biased kernel. ORT's own offline
fusions (`onnxruntime.transformers`) do not match these graphs: the UNet/DiT fusions expect no mask, the BERT one
its own mask form.

A site, found from each Softmax over the last axis, is (any of the optional steps may be absent):

    q3 -> Reshape [B, S, H, D] -> Transpose (0, 2, 1, 3) [-> Mul c_q]                       = Q
    k3 -> Reshape [B, T, H, D] -> Transpose (0, 2, 3, 1) [-> Mul c_k]                       = K^T
          (or Transpose (0, 2, 1, 3) -> Transpose (0, 1, 3, 2))
    v3 -> Reshape [B, T, H, D] -> Transpose (0, 2, 1, 3)                                    = V
    MatMul(Q, K^T) [-> Mul c | Div c] [-> Add bias] -> Softmax(-1) [-> Where(IsNaN(p), 0, p)] -> MatMul(., V)
        -> Transpose (0, 2, 1, 3) -> Reshape [B, S, H * D]                                  = out

and becomes MultiHeadAttention(q3, k3, v3, attention_bias = bias, num_heads = H, scale = c * c_q * c_k) -> out.
The scale factors must be graph constants (initializers, Constant nodes, or arithmetic on the static dimensions of
a Shape: SDPA's 1/sqrt(sqrt(D)) chains). The bias is broadcast to rank 4 ([1, ..., S, T], MultiHeadAttention's
(B or 1, H or 1, S, T)). The NaN guard of SDPA only changes rows whose every key is masked; such a row yields NaN
in both forms before the guard, and real inputs always let a query see at least one key.

Results equal the replaced subgraph within fp32 round-off (tests/quantize/test_attention_fusion.py); nodes that
no longer feed anything are removed. `fuse_attention` is policy-free: which graphs of which target get it is
decided in precision_targets.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cosyedge.quantize.cosyvoice2.graph_index import GraphIndex, finish, heads, prune, scalar, scaled, topological

MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class AttentionSite:
    """One rewritten attention: the Softmax it was found from, its heads, head size and total scale, and the bias
    tensor (None: unmasked)."""
    softmax: str
    heads: int
    head_dim: int
    scale: float
    bias: str | None


def _keys(g: GraphIndex, name: str) -> tuple[str, int, int] | None:
    found = heads(g, name, (0, 2, 3, 1))
    if found is None:
        outer = g.node(name, "Transpose")
        if outer is not None and tuple(g.attr(outer, "perm", ())) == (0, 1, 3, 2):
            found = heads(g, outer.input[0], (0, 2, 1, 3))
    return found


@dataclass
class _Site:
    q: str
    k: str
    v: str
    bias: str | None
    out: str
    heads: int
    head_dim: int
    scale: float
    softmax: str


def _match(g: GraphIndex, softmax: onnx.NodeProto) -> _Site | None:
    axis = g.attr(softmax, "axis", -1)
    if axis not in (-1, 3):
        return None
    probs = softmax.output[0]
    users = g.consumers.get(probs, [])
    if len(users) == 2 and {u.op_type for u in users} == {"IsNaN", "Where"}:        # SDPA's NaN guard
        where = next(u for u in users if u.op_type == "Where")
        isnan = next(u for u in users if u.op_type == "IsNaN")
        zero = scalar(g, where.input[1])
        if where.input[0] != isnan.output[0] or where.input[2] != probs or zero != 0.0:
            return None
        probs, users = where.output[0], g.consumers.get(where.output[0], [])
    if len(users) != 1 or users[0].op_type != "MatMul" or users[0].input[0] != probs:
        return None
    pv = users[0]
    values = heads(g, pv.input[1], (0, 2, 1, 3))
    after = g.consumers.get(pv.output[0], [])
    if values is None or len(after) != 1 or after[0].op_type != "Transpose" \
            or tuple(g.attr(after[0], "perm", ())) != (0, 2, 1, 3):
        return None
    merge = g.consumers.get(after[0].output[0], [])
    if len(merge) != 1 or merge[0].op_type != "Reshape":
        return None
    scores, bias = softmax.input[0], None
    add = g.node(scores, "Add")
    if add is not None:
        for i in (0, 1):
            inner = scaled(g, add.input[i])[0]
            if g.node(inner, "MatMul") is not None:
                scores, bias = add.input[i], add.input[1 - i]
                break
        else:
            return None
    scores, scale = scaled(g, scores)
    qk = g.node(scores, "MatMul")
    if qk is None:
        return None
    q_name, c_q = scaled(g, qk.input[0])
    k_name, c_k = scaled(g, qk.input[1])
    queries, keys = heads(g, q_name, (0, 2, 1, 3)), _keys(g, k_name)
    if queries is None or keys is None or not (queries[1:] == keys[1:] == values[1:]):
        return None
    return _Site(queries[0], keys[0], values[0], bias, merge[0].output[0], queries[1], queries[2],
                 scale * c_q * c_k, softmax.name or softmax.output[0])


def fuse_attention(src: Path | onnx.ModelProto, dst: Path | None = None, unbiased_fast_path: bool = True
                   ) -> tuple[onnx.ModelProto, list[AttentionSite]]:
    """Rewrite every attention site of the graph `src` (module docstring) into MultiHeadAttention; with
    `unbiased_fast_path`, a biased site runs the bias-free (flash) kernel whenever its bias is all zeros.

    Returns the model (written to `dst` when given, as one self-contained file) and the sites rewritten, in graph
    order. A graph without a matching site comes back unchanged with no sites.
    """
    model = onnx.load(str(src)) if not isinstance(src, onnx.ModelProto) else src
    g = GraphIndex(model)
    sites = [s for s in (_match(g, n) for n in g.graph.node if n.op_type == "Softmax") if s is not None]
    if not sites:
        return finish(model, dst), []
    new_nodes: dict[str, list[onnx.NodeProto]] = {}     # inserted before the node that produced the site's out
    ready: dict[str, tuple[str, str | None]] = {}        # bias -> (rank-4 bias, all-zero flag)
    replaced = {s.out for s in sites}
    for n, site in enumerate(sites):
        extra: list[onnx.NodeProto] = []
        prefix = f"/fused_attention_{n}"
        bias4, zero = None, None
        if site.bias is not None:
            if site.bias not in ready:
                ready[site.bias] = _prepare_bias(g, site.bias, f"/fused_attention_bias_{len(ready)}", extra,
                                                 unbiased_fast_path)
            bias4, zero = ready[site.bias]
        attrs = {"num_heads": site.heads, "scale": site.scale, "domain": MS_DOMAIN}
        if bias4 is None:
            extra.append(helper.make_node("MultiHeadAttention", [site.q, site.k, site.v], [site.out],
                                          name=f"{prefix}/MultiHeadAttention", **attrs))
        elif zero is None:
            extra.append(helper.make_node("MultiHeadAttention", [site.q, site.k, site.v, "", "", bias4], [site.out],
                                          name=f"{prefix}/MultiHeadAttention", **attrs))
        else:
            def branch(label: str, inputs: list[str]) -> onnx.GraphProto:
                out = f"{prefix}/{label}_output"
                return helper.make_graph(
                    [helper.make_node("MultiHeadAttention", inputs, [out], name=f"{prefix}/{label}", **attrs)],
                    f"{prefix}/{label}", [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])
            extra.append(helper.make_node(
                "If", [zero], [site.out], name=f"{prefix}/If",
                then_branch=branch("flash", [site.q, site.k, site.v]),
                else_branch=branch("biased", [site.q, site.k, site.v, "", "", bias4])))
        new_nodes.setdefault(site.out, []).extend(extra)
    nodes: list[onnx.NodeProto] = []
    for node in g.graph.node:
        hits = [o for o in node.output if o in replaced]
        if hits:
            nodes.extend(new_nodes[hits[0]])       # the site's output reshape: replaced by the fused node
            continue
        nodes.append(node)
    topological(nodes, g)
    del g.graph.node[:]
    g.graph.node.extend(nodes)
    prune(g.graph)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return finish(model, dst), [AttentionSite(s.softmax, s.heads, s.head_dim, s.scale, s.bias) for s in sites]


def _prepare_bias(g: GraphIndex, bias: str, prefix: str, out: list[onnx.NodeProto], fast_path: bool
                  ) -> tuple[str, str | None]:
    """A rank-4 view of `bias` (leading axes added) and, with `fast_path`, a bool scalar: every entry is 0."""
    rank = len(g.shapes[bias]) if bias in g.shapes else None
    if rank is None:
        raise ValueError(f"attention bias {bias!r} has no inferred rank; cannot give it MultiHeadAttention's shape")
    name = bias
    if rank < 4:
        axes = numpy_helper.from_array(np.arange(4 - rank, dtype=np.int64), f"{prefix}/axes")
        out.append(helper.make_node("Constant", [], [axes.name], value=axes))
        out.append(helper.make_node("Unsqueeze", [bias, axes.name], [f"{prefix}/rank4"], name=f"{prefix}/Unsqueeze"))
        name = f"{prefix}/rank4"
    if not fast_path:
        return name, None
    zero = numpy_helper.from_array(np.zeros((), np.float32), f"{prefix}/zero")
    out.extend([
        helper.make_node("Constant", [], [zero.name], value=zero),
        helper.make_node("Abs", [bias], [f"{prefix}/abs"], name=f"{prefix}/Abs"),
        helper.make_node("ReduceMax", [f"{prefix}/abs"], [f"{prefix}/max"], name=f"{prefix}/ReduceMax", keepdims=0),
        helper.make_node("Equal", [f"{prefix}/max", zero.name], [f"{prefix}/unbiased"], name=f"{prefix}/Equal"),
    ])
    return name, f"{prefix}/unbiased"


