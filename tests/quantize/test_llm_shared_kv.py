"""The shared key/value cache LLM graph (quantize/cosyvoice2/llm_shared_kv.py) and its calls (device kvcache.py):
the rewritten graph equals the exported (stacked-cache) graph it replaces within fp32 round-off, through the
runtime's own calls, for a batch of prompts of different lengths, decode steps past a buffer growth, and rows
joining and leaving; each decode step writes into the same buffers (nothing copied). The same for its form with
fewer kernel calls per step, as the cpu targets build it: residual sums fused with the norms after them
(quantize/cosyvoice2/llm_skip_norm.py), then query, key and value in one product, gate and up in another
(quantize/cosyvoice2/llm_packing.py).

The releases are random_init's `cosyvoice2-tiny` and `cosyvoice3-tiny` presets (golden tiny sizes, head size 16:
the smallest ONNX Runtime's GroupQueryAttention kernel runs; the golden tiny release's 8 keeps the stacked graph,
checked here too): the cpu targets of both families take the shared cache.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.kvcache import LLMCalls, SharedCache, StackedCache
from cosyedge.device.sessions import ShrinkingSession
from cosyedge.quantize.cosyvoice2.bundle import write_bundle
from cosyedge.quantize.cosyvoice2.llm_packing import pack_products
from cosyedge.quantize.cosyvoice2.llm_shared_kv import shared_kv_llm, supports_shared_kv
from cosyedge.quantize.cosyvoice2.llm_skip_norm import fuse_skip_norms
from cosyedge.quantize.cosyvoice2.random_init import write_random_release
from cosyedge.quantize.cosyvoice3.bundle import write_bundle as write_bundle3
from cosyedge.quantize.cosyvoice3.random_init import write_random_release as write_random_release3

TOLERANCE = 1e-4        # relative to the logits' magnitude (~20): measured <= 6e-6 absolute


FAMILIES = {"cosyvoice2": (write_random_release, write_bundle), "cosyvoice3": (write_random_release3, write_bundle3)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def graphs(request: pytest.FixtureRequest, golden_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, Path, Path]:
    """The stacked fp32 LLM of the family's `<family>-tiny` random release, its shared-cache rewrite (the v3
    LLM is the same Qwen2 graph with another speech vocabulary and stop set) and that rewrite fused and packed."""
    family = request.param
    write_release, write = FAMILIES[family]
    root = tmp_path_factory.mktemp(f"sharedkv-{family}")
    release = write_release(f"{family}-tiny", golden_dir / f"{family}-tiny", root / "release", seed=1)
    bundle = Bundle.load(write(release, root / "bundle"))
    assert bundle.manifest.family == family
    stacked = bundle.path(bundle.component("llm", "fp32").file)
    shared_kv_llm(stacked, root / "llm.shared.onnx")
    pack_products(fuse_skip_norms(root / "llm.shared.onnx")[0], root / "llm.packed.onnx")
    return stacked, root / "llm.shared.onnx", root / "llm.packed.onnx"


def _calls(path: Path) -> LLMCalls:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return LLMCalls(ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]))


def test_rewritten_graph_has_the_shared_contract(graphs, cv2_tiny_bundle):
    stacked, shared = onnx.load(str(graphs[0])), onnx.load(str(graphs[1]))
    layers = stacked.graph.input[1].type.tensor_type.shape.dim[0].dim_value
    names = [i.name for i in shared.graph.input]
    assert names[:5] == ["inputs_embeds", "position_ids", "seqlens_k", "total_sequence_length", "last_index"]
    assert names[5:] == [f"past_{k}_{i}" for i in range(layers) for k in ("key", "value")]
    assert [o.name for o in shared.graph.output][1:] == [f"present_{k}_{i}" for i in range(layers)
                                                          for k in ("key", "value")]
    ops = [n.op_type for n in shared.graph.node]
    assert ops.count("GroupQueryAttention") == layers and "Softmax" not in ops
    readers = {i: n.op_type for n in shared.graph.node for i in n.input if i.startswith("past_")}
    writers = {o: n.op_type for n in shared.graph.node for o in n.output if o.startswith("present_")}
    assert set(readers.values()) == set(writers.values()) == {"GroupQueryAttention"}     # the kernel, in place
    assert {p.key: p.value for p in shared.metadata_props}["kv_cache"] == "shared"
    golden = Bundle.load(cv2_tiny_bundle)
    assert supports_shared_kv(graphs[0]) and not supports_shared_kv(golden.path(golden.component("llm", "fp32").file))


def _run(calls: LLMCalls, prompts: list[np.ndarray], steps: list[np.ndarray], join: np.ndarray, leave: int):
    """Prefill `prompts`, decode `steps` ([B, 1, H] each); halfway, row `leave` leaves and `join` is prefilled and
    joins at the end (as the scheduler does). Returns every call's logits and the caches seen."""
    logits, cache = calls.prefill(prompts)
    seen, out = [cache], [logits]
    for i, step in enumerate(steps):
        if i == len(steps) // 2:
            joined_logits, joined = calls.prefill([join])
            out.append(joined_logits)
            keep = [r for r in range(len(cache.lengths)) if r != leave]
            cache = calls.merge([(cache, keep), (joined, [0])])
            step = step[[*keep, leave]]            # the joined row takes the leaving row's next input
        logits, cache = calls.decode(step, cache)
        seen.append(cache)
        out.append(logits)
    return out, seen


def test_shared_graph_equals_the_stacked_graph_through_the_runtime_calls(graphs):
    rng = np.random.default_rng(0)
    stacked, shared = _calls(graphs[0]), _calls(graphs[1])
    hidden = stacked._session.get_inputs()[0].shape[2]
    prompts = [rng.standard_normal((1, n, hidden)).astype(np.float32) for n in (9, 4, 13)]
    steps = [rng.standard_normal((3, 1, hidden)).astype(np.float32) for _ in range(150)]   # past the first buffer
    join = rng.standard_normal((1, 6, hidden)).astype(np.float32)
    want, stacked_caches = _run(stacked, prompts, steps, join, leave=1)
    got, shared_caches = _run(shared, prompts, steps, join, leave=1)
    assert isinstance(stacked_caches[-1], StackedCache) and isinstance(shared_caches[-1], SharedCache)
    assert len(got) == len(want) == 152
    for a, b in zip(want, got):
        assert a.shape == b.shape and np.abs(a - b).max() <= TOLERANCE * np.abs(a).max()
    assert shared_caches[-1].lengths.tolist() == stacked_caches[-1].lengths.tolist() == [9 + 150, 13 + 150, 6 + 75]
    assert shared_caches[-1].capacity > shared_caches[1].capacity           # the buffers grew on the way
    # left-aligned rows hold the stacked cache's right-aligned positions
    final, right = shared_caches[-1], stacked_caches[-1].key.numpy()
    for row, length in enumerate(final.lengths):
        np.testing.assert_allclose(final.key[:, row, :, :length], right[:, row, :, right.shape[3] - length:],
                                   atol=1e-5)


def test_packed_graph_has_one_product_per_activation_and_one_node_per_residual_norm(graphs):
    """Per layer: one query-key-value product feeding the kernel's packed input, one gate-up product and a Split,
    the output and down products: 4 MatMuls where the shared graph has 7. Every norm after a residual sum is one
    SkipSimplifiedLayerNormalization (two per layer but the first layer's input norm); two exported norms stay (the
    first layer's, over the embeddings, and the final one, after the last position's gather)."""
    shared, packed = onnx.load(str(graphs[1])), onnx.load(str(graphs[2]))
    layers = sum(n.op_type == "GroupQueryAttention" for n in shared.graph.node)
    count = lambda model, op: sum(n.op_type == op for n in model.graph.node)   # noqa: E731
    assert count(packed, "MatMul") == count(shared, "MatMul") - 3 * layers
    assert count(packed, "SkipSimplifiedLayerNormalization") == 2 * layers - 1
    assert count(shared, "Pow") == 2 * layers + 1 and count(packed, "Pow") == 2
    assert count(packed, "Split") == layers and count(packed, "GroupQueryAttention") == layers
    for node in (n for n in packed.graph.node if n.op_type == "GroupQueryAttention"):
        assert node.input[0].endswith("qkv_proj/Add_output_0") and list(node.input[1:3]) == ["", ""]
    _, attention, groups = pack_products(graphs[2])
    assert (attention, groups) == (0, 0) and fuse_skip_norms(graphs[2])[1] == 0      # nothing left to do


def test_packed_graph_equals_the_shared_graph_through_the_runtime_calls(graphs):
    rng = np.random.default_rng(5)
    shared, packed = _calls(graphs[1]), _calls(graphs[2])
    hidden = shared._session.get_inputs()[0].shape[2]
    prompts = [rng.standard_normal((1, n, hidden)).astype(np.float32) for n in (7, 11)]
    steps = [rng.standard_normal((2, 1, hidden)).astype(np.float32) for _ in range(140)]  # past the first buffer
    join = rng.standard_normal((1, 5, hidden)).astype(np.float32)
    want, _ = _run(shared, prompts, steps, join, leave=0)
    got, caches = _run(packed, prompts, steps, join, leave=0)
    assert len(got) == len(want) == 142 and caches[-1].capacity > caches[1].capacity
    for a, b in zip(want, got):
        assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


def test_decode_writes_into_the_same_buffers(graphs):
    rng = np.random.default_rng(3)
    calls = _calls(graphs[2])
    hidden = calls._session.get_inputs()[0].shape[2]
    _, cache = calls.prefill([rng.standard_normal((1, 5, hidden)).astype(np.float32)])
    buffer, pointer = cache.key, cache.key.ctypes.data
    assert not cache.key[:, 0, :, 5:].any()
    for step in range(3):
        _, cache = calls.decode(rng.standard_normal((1, 1, hidden)).astype(np.float32), cache)
        assert cache.key is buffer and cache.key.ctypes.data == pointer         # no copy, no new cache
        assert cache.key[:, 0, :, 5 + step].any() and not cache.key[:, 0, :, 6 + step:].any()


class _ShrinkRecorder:
    """An LLM session that records, per io-bound call, whether its run options shrink the memory arena."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self._session, self.shrinks = session, []

    def __getattr__(self, name: str):
        return getattr(self._session, name)

    def run_with_iobinding(self, binding, run_options=None):
        try:
            shrink = run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
        except (AttributeError, RuntimeError):  # no options, or options without the entry
            shrink = False
        self.shrinks.append(shrink)
        return self._session.run_with_iobinding(binding, run_options)


def test_prefill_hands_its_arena_back_and_decode_steps_keep_it(graphs):
    """Through a shrinking session (the runtime's CPU LLM, sessions.SessionConfig.shrink_graphs) a prefill, the
    LLM's largest activations (34 MB at full size for 137 positions, else held by the arena through the whole
    stream), ends by shrinking the arena; decode steps, every few milliseconds, keep it. Both cache contracts."""
    rng = np.random.default_rng(4)
    for path in graphs[:2]:
        recorder = _ShrinkRecorder(_calls(path)._session)
        calls = LLMCalls(ShrinkingSession(recorder))
        hidden = recorder.get_inputs()[0].shape[2]
        _, cache = calls.prefill([rng.standard_normal((1, 5, hidden)).astype(np.float32)])
        for _ in range(3):
            _, cache = calls.decode(rng.standard_normal((1, 1, hidden)).astype(np.float32), cache)
        assert recorder.shrinks == [True, False, False, False], path.name
