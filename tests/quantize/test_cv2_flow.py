"""CosyVoice2 flow stage against the official goldens (cosyvoice2-tiny/vectors/flow.npz, stream.npz) and its
ONNX export.

Tolerances (vectors/README.md): spks, mu, cond, encoder output, estimator output, mel atol 1e-4 (official fp32 vs
fp64 differs by <= 5.3e-6); the fixed noise checksums exact (sha256) or to the printed digits; the t schedule 1e-7
in torch (same float32 arithmetic), 1e-6 in numpy (its cosine grid may differ by 1 ulp). ONNX Runtime vs
golden / torch: atol 1e-4.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.flow import (CausalMaskedDiffWithXvec, build_flow, build_flow_random, fixed_noise,
                                               load_flow_state, prompt_condition)
from cosyedge.quantize.cosyvoice2 import flow_encoder
from cosyedge.quantize.cosyvoice2.empty_inputs import drop_empty_inputs
from cosyedge.quantize.cosyvoice2.precision_targets import CPU_ONLY_INPUTS
from cosyedge.quantize.cosyvoice2.flow_encoder import QUERY_BLOCKS, relative_shift
from cosyedge.quantize.cosyvoice2.flow_export import ENCODER_NAME, ESTIMATOR_NAME, export_flow
from cosyedge.quantize.cosyvoice2.release import Release

GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"
VECTORS = GOLDEN / "cosyvoice2-tiny" / "vectors"
ATOL = 1e-4
ONNX_ATOL = 1e-4
T_ATOL = 1e-7

CASES = sorted({k.split("__")[0] for k in np.load(VECTORS / "flow.npz").files if "__" in k}) \
    if (VECTORS / "flow.npz").is_file() else []
HEAVY = [c for c in CASES if c in ("sft0_s0", "zero_shot0_s0", "cross_lingual0_s0", "instruct20_s0")]
STREAM_CHUNKS = [(case, chunk["chunk"]) for case, info in
                 json.loads((VECTORS / "index.json").read_text())["stream"].items() for chunk in info["chunks"]] \
    if (VECTORS / "index.json").is_file() else []


@pytest.fixture(scope="module")
def flow(release: Release) -> CausalMaskedDiffWithXvec:
    return build_flow(release)


@pytest.fixture(scope="module")
def vectors(golden_dir: Path) -> dict[str, np.ndarray]:
    with np.load(golden_dir / "cosyvoice2-tiny" / "vectors" / "flow.npz") as z:
        return dict(z)


@pytest.fixture(scope="module")
def stream(golden_dir: Path) -> tuple[dict[str, np.ndarray], dict]:
    root = golden_dir / "cosyvoice2-tiny" / "vectors"
    with np.load(root / "stream.npz") as z:
        return dict(z), json.loads((root / "index.json").read_text())["stream"]


@pytest.fixture(scope="module")
def noise() -> np.ndarray:
    return fixed_noise()


@pytest.fixture(scope="module")
def graphs(flow: CausalMaskedDiffWithXvec, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return export_flow(flow, tmp_path_factory.mktemp("flow_onnx"))


@pytest.fixture(scope="module")
def sessions(graphs: dict[str, Path]) -> dict[str, ort.InferenceSession]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return {name: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            for name, path in graphs.items()}


def _case(vectors: dict[str, np.ndarray], case: str, name: str) -> torch.Tensor:
    return torch.from_numpy(vectors[f"{case}__{name}"])


def _encoder_token(prompt: np.ndarray, token: np.ndarray, lookahead: int, finalize: bool) -> np.ndarray:
    """The flow_encoder `token` input: prompt ++ tokens, plus K placeholders when finalizing."""
    parts = [prompt, token] + ([np.zeros((1, lookahead), np.int64)] if finalize else [])
    return np.concatenate(parts, axis=1).astype(np.int64)


def _flag(value: bool) -> np.ndarray:
    return np.array([int(value)], dtype=np.int64)


def _max_err(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


# ------------------------------------------------------------------------------------------ noise, loading

def test_fixed_noise_matches_published_checksums(noise: np.ndarray, vectors: dict[str, np.ndarray]) -> None:
    assert noise.shape == (1, 80, 15000) and noise.dtype == np.float32
    assert hashlib.sha256(noise.astype("<f4").tobytes()).hexdigest() == \
        "584a26e6eaad944407a96c5999aaa5cd0a6a359309a841eade68bf805c072322"
    assert abs(float(noise.astype(np.float64).sum()) - (-1291.2014)) < 1e-3
    np.testing.assert_allclose(noise.reshape(-1)[:5], [-1.12584, -1.15236, -0.25058, -0.43388, 0.84871], atol=1e-5)
    prefix = vectors["rand_noise_prefix"]
    np.testing.assert_array_equal(noise[:, :, :prefix.shape[2]], prefix)


def test_random_build_has_the_official_keys(release: Release) -> None:
    state = release.checkpoint("flow.pt")
    module = build_flow_random(release.hparams)
    assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {k: tuple(v.shape) for k, v in state.items()}


def test_strict_load_names_file_and_key(release: Release) -> None:
    state = release.checkpoint("flow.pt")
    module = build_flow_random(release.hparams)
    missing = {k: v for k, v in state.items() if k != "encoder.after_norm.bias"}
    with pytest.raises(ReleaseError, match=r"flow\.pt: missing key 'encoder\.after_norm\.bias'"):
        load_flow_state(module, missing)
    reshaped = dict(state, **{"encoder_proj.bias": torch.zeros(3)})
    with pytest.raises(ReleaseError, match=r"flow\.pt: key 'encoder_proj\.bias' has shape"):
        load_flow_state(module, reshaped)
    extra = dict(state, **{"decoder.rand_noise": torch.zeros(1)})
    with pytest.raises(ReleaseError, match=r"flow\.pt: unexpected key 'decoder\.rand_noise'"):
        load_flow_state(module, extra)


def test_unsupported_yaml_is_a_release_error(release: Release) -> None:
    flow = release.hparams["flow"]
    estimator = flow["decoder"]["estimator"]
    bad = type(estimator)(estimator.tag, estimator.target, dict(estimator.args, channels=[64, 64]))
    decoder = type(flow)(flow["decoder"].tag, flow["decoder"].target, dict(flow["decoder"].args, estimator=bad))
    hparams = dict(release.hparams, flow=type(flow)(flow.tag, flow.target, dict(flow.args, decoder=decoder)))
    with pytest.raises(ReleaseError, match="channels"):
        build_flow_random(hparams)


# ---------------------------------------------------------------------------------------- torch parity

@pytest.mark.parametrize("case", CASES)
def test_flow_case_matches_golden(flow: CausalMaskedDiffWithXvec, vectors: dict[str, np.ndarray],
                                  noise: np.ndarray, case: str) -> None:
    token, prompt = _case(vectors, case, "token"), _case(vectors, case, "prompt_token")
    prompt_feat, embedding = _case(vectors, case, "prompt_feat"), _case(vectors, case, "embedding")
    k = flow.config.pre_lookahead_len
    with torch.no_grad():
        mu, spks = flow.encode(torch.from_numpy(_encoder_token(prompt.numpy(), token.numpy(), k, True)), embedding,
                               torch.tensor([1]), torch.tensor([0]))
    assert _max_err(spks, vectors[f"{case}__spks"]) <= ATOL
    assert mu.shape == vectors[f"{case}__mu"].shape
    assert _max_err(mu, vectors[f"{case}__mu"]) <= ATOL
    cond = prompt_condition(prompt_feat, mu.shape[2])
    np.testing.assert_array_equal(cond.numpy(), vectors[f"{case}__cond"])
    mel = flow.inference(token, prompt, prompt_feat, embedding, torch.from_numpy(noise))
    assert mel.shape == vectors[f"{case}__mel"].shape
    assert _max_err(mel, vectors[f"{case}__mel"]) <= ATOL


@pytest.mark.parametrize("case", HEAVY)
def test_heavy_case_internals(flow: CausalMaskedDiffWithXvec, vectors: dict[str, np.ndarray], case: str) -> None:
    k = flow.config.pre_lookahead_len
    tokens = _encoder_token(vectors[f"{case}__prompt_token"], vectors[f"{case}__token"], k, True)
    est = {name: _case(vectors, case, f"est_{name}") for name in ("x", "mask", "mu", "t", "spks", "cond")}
    with torch.no_grad():
        hidden = flow.encode_hidden(torch.from_numpy(tokens), torch.tensor([1]), torch.tensor([0]))
        velocity = flow.velocity(**est, streaming=torch.tensor([0]))
        mu, spks = _case(vectors, case, "mu"), _case(vectors, case, "spks")
        full = flow.solve(mu, spks, _case(vectors, case, "cond"), torch.from_numpy(vectors["rand_noise_prefix"]),
                          torch.tensor([0]))
    assert _max_err(hidden, vectors[f"{case}__encoder_out"]) <= ATOL
    assert _max_err(flow.encoder_proj(hidden).detach(), vectors[f"{case}__encoder_proj_out"]) <= ATOL
    assert _max_err(velocity, vectors[f"{case}__est_out"]) <= ATOL
    assert _max_err(full, vectors[f"{case}__decoder_out_full"]) <= ATOL


def test_t_schedule_matches_every_estimator_call(flow: CausalMaskedDiffWithXvec, vectors: dict[str, np.ndarray]
                                                  ) -> None:
    """The t actually fed to each of the 10 calls (official accumulation t += dt) and the stored 4th call."""
    seen: list[float] = []
    estimator = flow.decoder.estimator
    handle = estimator.register_forward_pre_hook(lambda _m, args: seen.append(float(args[3][0])))
    try:
        case = HEAVY[0]
        with torch.no_grad():
            flow.solve(_case(vectors, case, "mu"), _case(vectors, case, "spks"), _case(vectors, case, "cond"),
                       torch.from_numpy(vectors["rand_noise_prefix"]), torch.tensor([0]))
    finally:
        handle.remove()
    for case in HEAVY:
        np.testing.assert_allclose(seen, vectors[f"{case}__est_t_all_steps"], rtol=0, atol=T_ATOL)
        np.testing.assert_allclose(vectors[f"{case}__est_t"], seen[3], rtol=0, atol=T_ATOL)


@pytest.mark.parametrize("case,chunk", STREAM_CHUNKS)
def test_streaming_chunk_mel(flow: CausalMaskedDiffWithXvec, stream: tuple[dict[str, np.ndarray], dict],
                             noise: np.ndarray, case: str, chunk: int) -> None:
    """Chunk i re-runs the flow on tokens[:offset + hop + 3] (streaming, not finalize); the last one finalizes."""
    data, table = stream
    info = table[case]["chunks"][chunk]
    tokens = torch.from_numpy(data[f"{case}__tokens"][:, :info["n_tokens_to_flow"]])
    args = (tokens, torch.from_numpy(data[f"{case}__prompt_token"]), torch.from_numpy(data[f"{case}__prompt_feat"]),
            torch.from_numpy(data[f"{case}__embedding"]), torch.from_numpy(noise))
    mel = flow.inference(*args, streaming=info["streaming"], finalize=info["finalize"])
    used = mel[:, :, flow.config.token_mel_ratio * info["token_offset"]:]
    expected = data[f"{case}__c{chunk}__flow_mel_used"]
    assert used.shape == expected.shape
    assert _max_err(used, expected) <= ATOL
    produced = args[1].shape[1] + tokens.shape[1] - flow.config.pre_lookahead_len
    if info["streaming"] and produced > flow.config.encoder.static_chunk_size:
        # more than one chunk: the chunk masks matter, full attention would not reproduce the chunk
        full = flow.inference(*args, streaming=False, finalize=info["finalize"])
        assert _max_err(full[:, :, flow.config.token_mel_ratio * info["token_offset"]:], expected) > 100 * ATOL


# ------------------------------------------------------------------------------------------------ ONNX

def test_onnx_signatures(sessions: dict[str, ort.InferenceSession]) -> None:
    def signature(items) -> list[tuple[str, str, list]]:
        return [(i.name, i.type, list(i.shape)) for i in items]

    encoder, estimator = sessions[ENCODER_NAME], sessions[ESTIMATOR_NAME]
    assert signature(encoder.get_inputs()) == [
        ("token", "tensor(int64)", [1, "tokens"]), ("embedding", "tensor(float)", [1, 192]),
        ("finalize", "tensor(int64)", [1]), ("streaming", "tensor(int64)", [1])]
    assert signature(encoder.get_outputs()) == [("mu", "tensor(float)", [1, 80, "frames"]),
                                                ("spks", "tensor(float)", [1, 80])]
    frames = ["batch", 80, "frames"]
    assert signature(estimator.get_inputs()) == [
        ("x", "tensor(float)", frames), ("mask", "tensor(float)", ["batch", 1, "frames"]),
        ("mu", "tensor(float)", frames), ("t", "tensor(float)", ["batch"]), ("spks", "tensor(float)", ["batch", 80]),
        ("cond", "tensor(float)", frames), ("streaming", "tensor(int64)", [1])]
    assert signature(estimator.get_outputs()) == [
        ("velocity", "tensor(float)", frames), ("present_hidden", "tensor(float)", [4, "batch", "kept", 64]),
        ("present_conv", "tensor(float)", ["batch", 1024, 2])]
    # the prompt state's inputs are optional: overridable initializers (none past, zeros, keep 0)
    assert signature(estimator.get_overridable_initializers()) == [
        ("past_hidden", "tensor(float)", [4, "state_rows", "past", 64]),
        ("past_conv", "tensor(float)", ["state_rows", 1024, 2]), ("keep", "tensor(int64)", [1]),
        ("past_hidden_q", "tensor(int8)", [4, "q_rows", "past_q", 64]),
        ("past_hidden_scale", "tensor(float)", [4, "q_rows", "past_q", 1])]
    meta = encoder.get_modelmeta().custom_metadata_map
    assert meta["pre_lookahead_len"] == "3" and meta["token_mel_ratio"] == "2" and meta["n_timesteps"] == "10"
    assert float(meta["inference_cfg_rate"]) == 0.7 and meta["estimator_chunk"] == "50"


def _streaming_feeds(rng: np.random.Generator, rows: int, frames: int) -> dict[str, np.ndarray]:
    """Random estimator feeds of a streaming call of `rows` x `frames`, without a prompt state."""
    return {"x": rng.standard_normal((rows, 80, frames), dtype=np.float32),
            "mask": np.ones((rows, 1, frames), np.float32),
            "mu": rng.standard_normal((rows, 80, frames), dtype=np.float32), "t": np.full(rows, 0.3, np.float32),
            "spks": rng.standard_normal((rows, 80), dtype=np.float32),
            "cond": np.zeros((rows, 80, frames), np.float32), "streaming": _flag(True)}


def test_a_past_fed_as_int8_is_the_past_of_its_float_values(sessions: dict[str, ort.InferenceSession]) -> None:
    """`past_hidden_q` / `past_hidden_scale` (the cpu targets' int8 prompt state, fed as it is kept) give the
    velocity and the kept state of the same past fed as float32 (values x scales), within float32 round-off; a
    past split between the two forms (float frames first) is one past of both; and the fed past matters (against
    no past). Rows: 2 state rows for 2 x rows, and 1 broadcast to 2."""
    estimator = sessions[ESTIMATOR_NAME]
    rng = np.random.default_rng(4)
    rows, frames, past = 2, 60, 50
    feeds = _streaming_feeds(rng, rows, frames) | {
        "past_conv": rng.standard_normal((rows, 1024, 2), dtype=np.float32), "keep": np.array([50], np.int64)}
    for state_rows in (2, 1):
        values = rng.integers(-127, 128, (4, state_rows, past, 64), dtype=np.int8)
        scales = rng.uniform(0.001, 0.05, (4, state_rows, past, 1)).astype(np.float32)
        hidden = values.astype(np.float32) * scales
        as_float = estimator.run(None, feeds | {"past_hidden": hidden})
        as_int8 = estimator.run(None, feeds | {"past_hidden_q": values, "past_hidden_scale": scales})
        split = estimator.run(None, feeds | {"past_hidden": hidden[:, :, :20], "past_hidden_q": values[:, :, 20:],
                                             "past_hidden_scale": scales[:, :, 20:]})
        for want, got, other in zip(as_float, as_int8, split):
            assert got.shape == want.shape == other.shape
            assert _max_err(got, want) <= 1e-5 * max(float(np.abs(want).max()), 1.0)
            assert _max_err(other, want) <= 1e-5 * max(float(np.abs(want).max()), 1.0)
        alone = estimator.run(["velocity"], {k: v for k, v in feeds.items() if k not in ("past_conv", "keep")})[0]
        assert _max_err(alone, as_float[0]) > 1e-3


def test_tensorrt_graphs_drop_the_int8_past_and_equal_the_graph_at_its_defaults(graphs: dict[str, Path],
                                                                                 sessions: dict[str, ort.InferenceSession]
                                                                                 ) -> None:
    """The graph the fp16 / trt-int8 estimators are built from (precision_targets.CPU_ONLY_INPUTS dropped,
    empty_inputs.py) has float32 / int64 inputs only, and gives every output of the exported graph run at the int8
    past's empty defaults, bit for bit, with and without a float past. A graph without those inputs is returned as
    it is; an empty input that reaches an op the rewrite does not know is refused."""
    estimator = sessions[ESTIMATOR_NAME]
    dropped = drop_empty_inputs(onnx.load(str(graphs[ESTIMATOR_NAME])), CPU_ONLY_INPUTS)
    assert {i.type.tensor_type.elem_type for i in dropped.graph.input} <= {onnx.TensorProto.FLOAT,
                                                                          onnx.TensorProto.INT64}
    assert not {i.name for i in dropped.graph.input} & set(CPU_ONLY_INPUTS)
    assert not {t.name for t in dropped.graph.initializer} & set(CPU_ONLY_INPUTS)
    without = ort.InferenceSession(dropped.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    rows, frames = 2, 60
    feeds = _streaming_feeds(rng, rows, frames)
    past = {"past_hidden": rng.standard_normal((4, rows, 50, 64), dtype=np.float32),
            "past_conv": rng.standard_normal((rows, 1024, 2), dtype=np.float32), "keep": np.array([50], np.int64)}
    for fed in (feeds, feeds | past):
        for want, got in zip(estimator.run(None, fed), without.run(None, fed)):
            assert np.array_equal(want, got)
    encoder = onnx.load(str(graphs[ENCODER_NAME]))
    assert drop_empty_inputs(encoder, CPU_ONLY_INPUTS) is encoder
    broken = onnx.load(str(graphs[ESTIMATOR_NAME]))
    broken.graph.output.append(onnx.helper.make_tensor_value_info("past_hidden_q", onnx.TensorProto.INT8, None))
    with pytest.raises(ValueError, match="graph output"):
        drop_empty_inputs(broken, CPU_ONLY_INPUTS)


def test_relative_shift_is_the_per_element_gather_with_a_flat_index(graphs: dict[str, Path]) -> None:
    """The encoder's relative shift (flow_encoder.relative_shift) picks exactly what the per-element gather of the
    official attention picks, and the exported encoder holds no GatherElements, whose int64 index has the full
    [B, H, T, T] shape of the scores (twice their memory)."""
    for size in (1, 2, 7, 40):
        position = torch.randn(2, 3, size, 2 * size - 1)
        rows = torch.arange(size)
        picked = torch.gather(position, 3, (size - 1 - rows[:, None] + rows[None]).expand(2, 3, size, size))
        assert torch.equal(relative_shift(position), picked)
    ops = {node.op_type for node in onnx.load(str(graphs[ENCODER_NAME])).graph.node}
    assert "GatherElements" not in ops and "Gather" in ops
    position = torch.randn(1, 2, 9, 17)
    for first, end in ((0, 2), (2, 5), (5, 9), (4, 4)):   # a block of query rows shifts as the same rows of all
        assert torch.equal(relative_shift(position[:, :, first:end], first), relative_shift(position)[:, :, first:end])


def test_encoder_attention_runs_in_query_blocks_with_the_output_of_one(flow: CausalMaskedDiffWithXvec, graphs,
                                                                        sessions, monkeypatch) -> None:
    """The encoder's attention runs in QUERY_BLOCKS blocks of queries, so its [H, T, T] and [H, T, 2T-1] score
    tensors are held a block at a time (the flow encoder's peak memory at full size): the output equals one block's
    within float32 round-off, also with fewer frames than blocks (empty blocks), and the exported graph has a
    softmax per block in every layer; ONNX Runtime runs it on 1 and 2 tokens."""
    assert QUERY_BLOCKS >= 4
    encoder = flow.encoder
    layers = len(encoder.encoders) + len(encoder.up_encoders)
    softmaxes = [n for n in onnx.load(str(graphs[ENCODER_NAME])).graph.node if n.op_type == "Softmax"]
    assert len(softmaxes) == layers * QUERY_BLOCKS
    attention = encoder.encoders[0].self_attn
    torch.manual_seed(0)
    for size in (1, 3, 50):
        x = torch.randn(1, size, attention.d_k * attention.heads)
        visible = torch.rand(size, size) > 0.3
        visible[:, 0] = True
        pos_emb = flow_encoder.relative_positions(size, x.shape[2])
        with torch.no_grad():
            blocked = attention(x, pos_emb, visible)
            monkeypatch.setattr(flow_encoder, "QUERY_BLOCKS", 1)
            whole = attention(x, pos_emb, visible)
            monkeypatch.setattr(flow_encoder, "QUERY_BLOCKS", QUERY_BLOCKS)
        assert _max_err(blocked, whole) <= 1e-5 * float(whole.abs().max()), size
    for tokens in (1, 2):   # and the 3 look-ahead tokens (`_encoder_token`): 2 and 4 frames
        token = _encoder_token(np.zeros((1, 0), np.int64), np.arange(1, tokens + 1, dtype=np.int64)[None], 3, True)
        mu, _ = sessions[ENCODER_NAME].run(None, {"token": token, "embedding": np.ones((1, 192), np.float32),
                                                  "finalize": _flag(True), "streaming": _flag(False)})
        assert 2 * tokens in mu.shape and np.isfinite(mu).all(), mu.shape


@pytest.mark.parametrize("case", HEAVY)
def test_onnx_encoder_matches_golden(sessions: dict[str, ort.InferenceSession], vectors: dict[str, np.ndarray],
                                     case: str) -> None:
    token = _encoder_token(vectors[f"{case}__prompt_token"], vectors[f"{case}__token"], 3, True)
    mu, spks = sessions[ENCODER_NAME].run(None, {"token": token, "embedding": vectors[f"{case}__embedding"],
                                                 "finalize": _flag(True), "streaming": _flag(False)})
    assert _max_err(mu, vectors[f"{case}__mu"]) <= ONNX_ATOL
    assert _max_err(spks, vectors[f"{case}__spks"]) <= ONNX_ATOL


def test_onnx_encoder_streaming_chunk_matches_torch(flow: CausalMaskedDiffWithXvec,
                                                    sessions: dict[str, ort.InferenceSession],
                                                    stream: tuple[dict[str, np.ndarray], dict]) -> None:
    """A non-final chunk: the last 3 tokens are look-ahead context, chunk masks on."""
    data, table = stream
    info = table["stream_zero_shot"]["chunks"][1]
    token = np.concatenate([data["stream_zero_shot__prompt_token"],
                            data["stream_zero_shot__tokens"][:, :info["n_tokens_to_flow"]]], axis=1)
    embedding = data["stream_zero_shot__embedding"]
    mu, _ = sessions[ENCODER_NAME].run(None, {"token": token, "embedding": embedding, "finalize": _flag(False),
                                              "streaming": _flag(True)})
    with torch.no_grad():
        expected, _ = flow.encode(torch.from_numpy(token), torch.from_numpy(embedding), torch.tensor([0]),
                                  torch.tensor([1]))
    assert mu.shape[2] == 2 * (token.shape[1] - 3)
    assert _max_err(mu, expected) <= ONNX_ATOL


@pytest.mark.parametrize("case", HEAVY)
def test_onnx_estimator_matches_golden(sessions: dict[str, ort.InferenceSession], vectors: dict[str, np.ndarray],
                                       case: str) -> None:
    feeds = {name: vectors[f"{case}__est_{name}"] for name in ("x", "mask", "mu", "t", "spks", "cond")}
    (velocity,) = sessions[ESTIMATOR_NAME].run(["velocity"], feeds | {"streaming": _flag(False)})
    assert _max_err(velocity, vectors[f"{case}__est_out"]) <= ONNX_ATOL


def test_onnx_estimator_streaming_and_padded_batch(flow: CausalMaskedDiffWithXvec,
                                                   sessions: dict[str, ort.InferenceSession],
                                                   vectors: dict[str, np.ndarray]) -> None:
    """Chunk mask on (T > one chunk); a shorter request right-padded in the same batch keeps its own result."""
    case = HEAVY[0]
    feeds = {name: vectors[f"{case}__est_{name}"] for name in ("x", "mask", "mu", "t", "spks", "cond")}
    run = sessions[ESTIMATOR_NAME]
    (streamed,) = run.run(["velocity"], feeds | {"streaming": _flag(True)})
    with torch.no_grad():
        expected = flow.velocity(**{k: torch.from_numpy(v) for k, v in feeds.items()}, streaming=torch.tensor([1]))
    assert _max_err(streamed, expected) <= ONNX_ATOL
    (full,) = run.run(["velocity"], feeds | {"streaming": _flag(False)})
    assert _max_err(streamed, full) > 100 * ONNX_ATOL

    short = feeds["x"].shape[2] - 17
    alone = {k: (v[..., :short] if v.ndim == 3 else v) for k, v in feeds.items()}
    (single,) = run.run(["velocity"], alone | {"streaming": _flag(False)})
    padded = {k: np.concatenate([feeds[k], np.pad(alone[k], [(0, 0)] * (v.ndim - 1) + [(0, 17)])])
              if v.ndim == 3 else np.concatenate([v, v]) for k, v in feeds.items()}
    (batched,) = run.run(["velocity"], padded | {"streaming": _flag(False)})
    assert _max_err(batched[:2], full) <= ONNX_ATOL
    assert _max_err(batched[2:, :, :short], single) <= ONNX_ATOL
    assert np.all(batched[2:, :, short:] == 0)


def _numpy_euler(estimator: ort.InferenceSession, mu: np.ndarray, spks: np.ndarray, cond: np.ndarray,
                 noise: np.ndarray, cfg_rate: float, n_timesteps: int) -> tuple[np.ndarray, list[float]]:
    """The official solve_euler with CFG, in float32 numpy around the ONNX estimator (what the device runs)."""
    t_span = 1 - np.cos(np.linspace(0, 1, n_timesteps + 1, dtype=np.float32) * 0.5 * np.pi)
    frames = mu.shape[2]
    x = noise[:, :, :frames].copy()
    zeros = np.zeros_like(mu)
    feeds = {"mask": np.ones((2, 1, frames), np.float32), "mu": np.concatenate([mu, zeros]),
             "spks": np.concatenate([spks, np.zeros_like(spks)]), "cond": np.concatenate([cond, zeros]),
             "streaming": _flag(False)}
    t, dt = t_span[0], t_span[1] - t_span[0]
    seen = []
    for step in range(1, n_timesteps + 1):
        seen.append(float(t))
        (v,) = estimator.run(["velocity"], feeds | {"x": np.concatenate([x, x]), "t": np.full(2, t, np.float32)})
        x = x + dt * ((1.0 + cfg_rate) * v[:1] - cfg_rate * v[1:])
        t = t + dt
        if step < n_timesteps:
            dt = t_span[step + 1] - t
    return x.astype(np.float32), seen


@pytest.mark.parametrize("case", HEAVY)
def test_onnx_numpy_euler_reproduces_mel(flow: CausalMaskedDiffWithXvec, sessions: dict[str, ort.InferenceSession],
                                         vectors: dict[str, np.ndarray], noise: np.ndarray, case: str) -> None:
    token = _encoder_token(vectors[f"{case}__prompt_token"], vectors[f"{case}__token"], 3, True)
    mu, spks = sessions[ENCODER_NAME].run(None, {"token": token, "embedding": vectors[f"{case}__embedding"],
                                                 "finalize": _flag(True), "streaming": _flag(False)})
    prompt_feat = vectors[f"{case}__prompt_feat"]
    cond = np.zeros_like(mu)
    cond[:, :, :prompt_feat.shape[1]] = prompt_feat.transpose(0, 2, 1)
    full, seen = _numpy_euler(sessions[ESTIMATOR_NAME], mu, spks, cond, noise, flow.config.inference_cfg_rate, 10)
    np.testing.assert_allclose(seen, vectors[f"{case}__est_t_all_steps"], rtol=0, atol=1e-6)
    assert _max_err(full[:, :, prompt_feat.shape[1]:], vectors[f"{case}__mel"]) <= ATOL
