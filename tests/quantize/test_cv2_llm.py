"""CosyVoice2 LLM stage against the official goldens (cosyvoice2-tiny/vectors/llm.npz) and its ONNX export.

Tolerances (vectors/README.md): lm_input, min/max len, greedy tokens and stop ids exact; log-probs atol 1e-4
(official fp32 vs fp64 differs by <= 1.8e-5; the smallest greedy top-1 margin is 1.3e-3 nats). ONNX Runtime vs
the torch module: logits and caches atol 1e-4.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from cosyedge.device.cosyvoice2.llm import cache_dims, prefill_feeds
from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.llm import (LLMConfig, Qwen2LM, build_llm, build_llm_random, greedy_choice,
                                              load_llm_state)
from cosyedge.quantize.cosyvoice2.llm_export import embedding_tables, export_llm
from cosyedge.quantize.cosyvoice2.release import Release

GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"
RELEASE_DIR = GOLDEN / "cosyvoice2-tiny"
LLM_NPZ = RELEASE_DIR / "vectors" / "llm.npz"
LOGP_ATOL = 1e-4
ONNX_ATOL = 1e-4

CASES = sorted({k.split("__")[0] for k in np.load(LLM_NPZ).files})  # a missing golden file fails collection
HEAVY = [c for c in CASES if c in ("sft0_s0", "zero_shot0_s0", "cross_lingual0_s0", "instruct20_s0")]


@pytest.fixture(scope="module")
def gold() -> dict[str, np.ndarray]:
    with np.load(LLM_NPZ) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def lm(release: Release) -> Qwen2LM:
    return build_llm(release)


@pytest.fixture(scope="module")
def graphs(lm: Qwen2LM, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ort.InferenceSession]:
    paths = export_llm(lm, tmp_path_factory.mktemp("llm_onnx"))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return {name: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            for name, path in paths.items()}


def _lm_input(lm: Qwen2LM, gold: dict[str, np.ndarray], case: str) -> torch.Tensor:
    return lm.lm_input(gold[f"{case}__text_token"], gold[f"{case}__prompt_text_token"],
                       gold[f"{case}__prompt_speech_token"])


@torch.no_grad()
def _teacher_forced_logp(lm: Qwen2LM, lm_input: torch.Tensor, tokens: np.ndarray) -> np.ndarray:
    """log_softmax of the speech logits at every step while feeding `tokens`: [len(tokens) + 1, V]."""
    logits, key, value = lm.prefill(lm_input)
    rows = [logits]
    for token in tokens:
        logits, key, value = lm.decode_step(lm.token_embedding(int(token)), key, value)
        rows.append(logits)
    return torch.log_softmax(torch.cat(rows), dim=-1).numpy()


def test_random_build_has_the_official_layout(release: Release) -> None:
    module = build_llm_random(release.hparams, release.qwen_config)
    state = release.checkpoint("llm.pt")
    assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {k: tuple(v.shape) for k, v in state.items()}
    assert module.llm.model.lm_head.weight is module.body.embed_tokens.weight  # BlankEN ties the text head


def test_load_names_file_and_key(release: Release) -> None:
    module = build_llm_random(release.hparams, release.qwen_config)
    state = release.checkpoint("llm.pt")
    missing = {k: v for k, v in state.items() if k != "llm_decoder.bias"}
    with pytest.raises(ReleaseError, match=r"llm\.pt: missing key 'llm_decoder\.bias'"):
        load_llm_state(module, missing)
    bad = dict(state, **{"speech_embedding.weight": state["speech_embedding.weight"][:-1]})
    with pytest.raises(ReleaseError, match=r"llm\.pt: key 'speech_embedding\.weight' has shape"):
        load_llm_state(module, bad)


def test_config_rejects_other_llm_class(release: Release) -> None:
    hparams = dict(release.hparams, llm=type(release.hparams["llm"])("new", "cosyvoice.llm.llm.TransformerLM", {}))
    with pytest.raises(ReleaseError, match="Qwen2LM"):
        LLMConfig.from_release(hparams, release.qwen_config)


@pytest.mark.parametrize("case", CASES)
def test_lm_input_and_lengths_exact(lm: Qwen2LM, gold: dict[str, np.ndarray], case: str) -> None:
    lm_input = _lm_input(lm, gold, case).detach().numpy()
    np.testing.assert_array_equal(lm_input, gold[f"{case}__lm_input"])
    # the runtime's numpy gather from the exported tables gives the same tensor
    t = embedding_tables(lm)
    ids = np.concatenate([gold[f"{case}__prompt_text_token"][0], gold[f"{case}__text_token"][0]])
    rows = [t["llm_embedding"][:1], t["embed_tokens"][ids], t["llm_embedding"][1:2],
            t["speech_embedding"][gold[f"{case}__prompt_speech_token"][0]]]
    np.testing.assert_array_equal(np.concatenate(rows)[None], gold[f"{case}__lm_input"])
    n_text = gold[f"{case}__text_token"].shape[1]
    assert lm.config.min_max_len(n_text) == tuple(gold[f"{case}__min_max_len"].tolist())


@pytest.mark.parametrize("case", CASES)
def test_teacher_forced_greedy_logp(lm: Qwen2LM, gold: dict[str, np.ndarray], case: str) -> None:
    tokens = gold[f"{case}__greedy_tokens"]
    logp = _teacher_forced_logp(lm, _lm_input(lm, gold, case), tokens)
    assert logp.shape[0] == tokens.shape[0] + 1
    top_idx = gold[f"{case}__greedy_logp_topk_indices"]
    np.testing.assert_allclose(np.take_along_axis(logp, top_idx, axis=1), gold[f"{case}__greedy_logp_topk_values"],
                               rtol=0, atol=LOGP_ATOL)
    np.testing.assert_allclose(logp[:, list(lm.config.stop_ids)], gold[f"{case}__greedy_logp_stop_ids"],
                               rtol=0, atol=LOGP_ATOL)
    if f"{case}__greedy_logp" in gold:
        np.testing.assert_allclose(logp, gold[f"{case}__greedy_logp"], rtol=0, atol=LOGP_ATOL)


@pytest.mark.parametrize("case", HEAVY)
def test_teacher_forced_ras_logp(lm: Qwen2LM, gold: dict[str, np.ndarray], case: str) -> None:
    logp = _teacher_forced_logp(lm, _lm_input(lm, gold, case), gold[f"{case}__ras_tokens"])
    np.testing.assert_allclose(logp, gold[f"{case}__teacher_forced_ras_logp"], rtol=0, atol=LOGP_ATOL)


@pytest.mark.parametrize("case", CASES)
def test_greedy_decode_exact(lm: Qwen2LM, gold: dict[str, np.ndarray], case: str) -> None:
    min_len, max_len = lm.config.min_max_len(gold[f"{case}__text_token"].shape[1])
    result = lm.greedy_decode(_lm_input(lm, gold, case), min_len, max_len)
    assert result.tokens == gold[f"{case}__greedy_tokens"].tolist()
    assert result.stop_token == int(gold[f"{case}__greedy_stop_token"][0])


def test_greedy_choice_eos_rule(lm: Qwen2LM) -> None:
    c = lm.config
    scores = np.zeros(c.speech_vocab, np.float32)
    scores[c.eos] = 5.0
    scores[3] = 1.0
    assert greedy_choice(scores, step=0, min_len=1, config=c) == 3       # eos masked before min_len
    assert greedy_choice(scores, step=1, min_len=1, config=c) == c.eos
    scores[c.eos + 1] = 9.0                                                # other stop ids are never masked
    assert greedy_choice(scores, step=0, min_len=1, config=c) == c.eos + 1


def _padded(inputs: list[torch.Tensor], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(x.shape[1] for x in inputs)
    embeds = torch.zeros(len(inputs), length, inputs[0].shape[2])
    mask = torch.zeros(len(inputs), length, dtype=torch.int64)
    for row, x in enumerate(inputs):
        span = slice(length - x.shape[1], length) if left else slice(0, x.shape[1])
        embeds[row, span] = x[0]
        mask[row, span] = 1
    return embeds, mask


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
@torch.no_grad()
def test_padded_batch_matches_single_rows(lm: Qwen2LM, gold: dict[str, np.ndarray], left: bool) -> None:
    cases = ["sft0_s0", "zero_shot0_s0"]
    inputs = [_lm_input(lm, gold, c) for c in cases]
    embeds, mask = _padded(inputs, left)
    logits, key, value = lm.prefill(embeds, mask)
    singles = [lm.prefill(x) for x in inputs]
    for row, (single, _, _) in enumerate(singles):
        np.testing.assert_allclose(logits[row].numpy(), single[0].numpy(), rtol=0, atol=ONNX_ATOL)
    steps = [gold[f"{c}__greedy_tokens"][:3] for c in cases]
    valid = mask.sum(dim=1)
    for i in range(3):
        step_in = torch.cat([lm.token_embedding(int(s[i])) for s in steps])
        mask = torch.cat([mask, torch.ones(len(cases), 1, dtype=torch.int64)], dim=1)
        logits, key, value = lm.decode_step(step_in, key, value, mask, (valid + i).reshape(-1, 1))
        singles = [lm.decode_step(lm.token_embedding(int(s[i])), k, v) for s, (_, k, v) in zip(steps, singles)]
        for row, (single, _, _) in enumerate(singles):
            np.testing.assert_allclose(logits[row].numpy(), single[0].numpy(), rtol=0, atol=ONNX_ATOL)


# ---------------------------------------------------------------- ONNX


def _prefill(graph: ort.InferenceSession, embeds: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    """The prefill call of the one `llm` graph (the runtime's feeds: empty caches, P = 0)."""
    return graph.run(None, prefill_feeds(embeds, mask, cache_dims(graph)))


def _decode(graph: ort.InferenceSession, embed: np.ndarray, key: np.ndarray, value: np.ndarray) -> list[np.ndarray]:
    p = key.shape[3]
    return graph.run(None, {"inputs_embeds": embed, "past_key": key, "past_value": value,
                            "attention_mask": np.ones((1, p + 1), np.int64), "position_ids": np.array([[p]], np.int64)})


def test_one_llm_graph(graphs: dict[str, ort.InferenceSession], lm: Qwen2LM) -> None:
    """One graph serves prefill and decode: n new positions after P cached ones, every size dynamic."""
    assert list(graphs) == ["llm"]
    c = lm.config.qwen
    v = lm.config.speech_vocab
    s = graphs["llm"]
    cache = [c.num_layers, "batch", c.num_kv_heads, "past", c.head_dim]
    present = [c.num_layers, "batch", c.num_kv_heads, "total", c.head_dim]
    assert [(i.name, i.type, i.shape) for i in s.get_inputs()] == [
        ("inputs_embeds", "tensor(float)", ["batch", "length", c.hidden_size]),
        ("past_key", "tensor(float)", cache), ("past_value", "tensor(float)", cache),
        ("attention_mask", "tensor(int64)", ["batch", "total"]), ("position_ids", "tensor(int64)", ["batch", "length"])]
    assert [(o.name, o.type, o.shape) for o in s.get_outputs()] == [
        ("logits", "tensor(float)", ["batch", v]), ("present_key", "tensor(float)", present),
        ("present_value", "tensor(float)", present)]


@pytest.mark.parametrize("case", HEAVY)
@torch.no_grad()
def test_onnx_matches_torch(lm: Qwen2LM, graphs: dict[str, ort.InferenceSession], gold: dict[str, np.ndarray],
                            case: str) -> None:
    lm_input = _lm_input(lm, gold, case)
    out = _prefill(graphs["llm"], lm_input.numpy(), np.ones(lm_input.shape[:2], np.int64))
    ref = lm.prefill(lm_input)
    for got, want in zip(out, ref):
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=ONNX_ATOL)
    _, key, value = out
    _, tkey, tvalue = ref
    for token in gold[f"{case}__greedy_tokens"][:5]:
        embed = lm.token_embedding(int(token))
        out = _decode(graphs["llm"], embed.numpy(), key, value)
        ref = lm.decode_step(embed, tkey, tvalue)
        for got, want in zip(out, ref):
            np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=ONNX_ATOL)
        _, key, value = out
        _, tkey, tvalue = ref


@torch.no_grad()
def test_onnx_several_new_positions_after_a_cache(lm: Qwen2LM, graphs: dict[str, ort.InferenceSession],
                                                  gold: dict[str, np.ndarray]) -> None:
    """P > 0 and n > 1 in one call (the general pass): a prompt prefilled in two parts equals one prefill."""
    lm_input = _lm_input(lm, gold, "zero_shot0_s0").numpy()
    length, head = lm_input.shape[1], 7
    whole = _prefill(graphs["llm"], lm_input, np.ones((1, length), np.int64))
    _, key, value = _prefill(graphs["llm"], lm_input[:, :head], np.ones((1, head), np.int64))
    rest = graphs["llm"].run(None, {"inputs_embeds": lm_input[:, head:], "past_key": key, "past_value": value,
                                    "attention_mask": np.ones((1, length), np.int64),
                                    "position_ids": np.arange(head, length, dtype=np.int64)[None]})
    for got, want in zip(rest, whole):
        np.testing.assert_allclose(got, want, rtol=0, atol=ONNX_ATOL)


@pytest.mark.parametrize("case", CASES)
def test_onnx_greedy_decode_exact(lm: Qwen2LM, graphs: dict[str, ort.InferenceSession],
                                  gold: dict[str, np.ndarray], case: str) -> None:
    """The runtime's loop: numpy embedding gathers + the one graph (prefill, then one position per call)."""
    t = embedding_tables(lm)
    config = lm.config
    lm_input = gold[f"{case}__lm_input"]
    min_len, max_len = config.min_max_len(gold[f"{case}__text_token"].shape[1])
    logits, key, value = _prefill(graphs["llm"], lm_input, np.ones(lm_input.shape[:2], np.int64))
    tokens, stop = [], -1
    for step in range(max_len):
        token = greedy_choice(logits[0], step, min_len, config)
        if token in config.stop_ids:
            stop = token
            break
        tokens.append(token)
        logits, key, value = _decode(graphs["llm"], t["speech_embedding"][token].reshape(1, 1, -1), key, value)
    assert tokens == gold[f"{case}__greedy_tokens"].tolist()
    assert stop == int(gold[f"{case}__greedy_stop_token"][0])


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
@torch.no_grad()
def test_onnx_padded_batch(lm: Qwen2LM, graphs: dict[str, ort.InferenceSession], gold: dict[str, np.ndarray],
                           left: bool) -> None:
    cases = ["cross_lingual1_s0", "instruct20_s0", "sft2_s0"]
    inputs = [_lm_input(lm, gold, c) for c in cases]
    embeds, mask = _padded(inputs, left)
    logits, key, value = _prefill(graphs["llm"], embeds.numpy(), mask.numpy())
    singles = [lm.prefill(x) for x in inputs]
    np.testing.assert_allclose(logits, torch.cat([s[0] for s in singles]).numpy(), rtol=0, atol=ONNX_ATOL)
    mask = mask.numpy()
    valid = mask.sum(axis=1)
    steps = [gold[f"{c}__greedy_tokens"][:2] for c in cases]
    for i in range(2):
        step_in = torch.cat([lm.token_embedding(int(s[i])) for s in steps])
        mask = np.concatenate([mask, np.ones((len(cases), 1), np.int64)], axis=1)
        logits, key, value = graphs["llm"].run(None, {
            "inputs_embeds": step_in.numpy(), "past_key": key, "past_value": value, "attention_mask": mask,
            "position_ids": (valid + i).reshape(-1, 1).astype(np.int64)})
        singles = [lm.decode_step(lm.token_embedding(int(s[i])), k, v) for s, (_, k, v) in zip(steps, singles)]
        np.testing.assert_allclose(logits, torch.cat([s[0] for s in singles]).numpy(), rtol=0, atol=ONNX_ATOL)
