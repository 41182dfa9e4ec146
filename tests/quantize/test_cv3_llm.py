"""Fun-CosyVoice3 LLM (CosyVoice3LM) against the official goldens (cosyvoice3-tiny/vectors: e2e_*.npz, llm.npz).

Tolerances (vectors/README.md section 7): lm_input exact (pure gathers); log-probs abs 1e-4 (official fp32 spread
~1e-5); token ids, stop ids, min/max lengths exact.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosyedge.quantize.cosyvoice3.llm import CosyVoice3LM, build_llm, greedy_choice
from cosyedge.quantize.cosyvoice3.release import Release3

CASES = [f"{mode}_{i}" for mode in ("zero_shot", "cross_lingual", "instruct2") for i in (1, 2, 3)]
LOGP_ATOL = 1e-4
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module")
def llm(cv3_release: Release3) -> CosyVoice3LM:
    return build_llm(cv3_release)


def _lm_input(llm: CosyVoice3LM, e) -> torch.Tensor:
    return llm.lm_input(e["seg0_text_token"], e["seg0_prompt_text_token"], e["seg0_llm_prompt_speech_token"])


def test_special_ids(llm: CosyVoice3LM) -> None:
    c = llm.config
    assert (c.sos, c.eos, c.task_id, c.fill) == (6561, 6562, 6563, 6564)
    assert c.speech_vocab == 6761 and c.stop_ids == tuple(range(6561, 6761))
    assert c.min_len_masked_id == 6561                      # official quirk: sos, not eos, is masked
    assert llm.llm_decoder.bias is None and not hasattr(llm, "llm_embedding")


@pytest.mark.parametrize("case", CASES)
def test_lm_input_exact(llm: CosyVoice3LM, cv3_vectors: Path, case: str) -> None:
    e = np.load(cv3_vectors / f"e2e_{case}.npz")
    with torch.no_grad():
        got = _lm_input(llm, e).numpy()
    np.testing.assert_array_equal(got, e["seg0_lm_input"])
    assert list(llm.config.min_max_len(e["seg0_text_token"].shape[1])) == e["seg0_min_len_max_len"].tolist()


@pytest.mark.parametrize("case", CASES)
def test_greedy_decode(llm: CosyVoice3LM, cv3_vectors: Path, case: str) -> None:
    """KV-cached greedy decoding: tokens and stop id exact; the first 4 raw log-prob rows and the per-step top-8
    (after the min_len mask) within 1e-4."""
    e = np.load(cv3_vectors / f"e2e_{case}.npz")
    c = llm.config
    with torch.no_grad():
        lm_input = _lm_input(llm, e)
        min_len, max_len = c.min_max_len(e["seg0_text_token"].shape[1])
        logits, key, value = llm.prefill(lm_input)
        picked, err = [], 0.0
        for step in range(max_len):
            logp = torch.log_softmax(logits[0], dim=-1).numpy()
            if step < 4:
                err = max(err, float(np.abs(logp - e["seg0_logp_first4"][step]).max()))
            scores = logp.copy()
            if step < min_len:
                scores[c.min_len_masked_id] = -np.inf
            assert bool(step < min_len) == bool(e["seg0_ignore_eos"][step])
            np.testing.assert_array_equal(np.argsort(-scores, kind="stable")[:8], e["seg0_top8_ids"][step])
            err = max(err, float(np.abs(scores[e["seg0_top8_ids"][step]] - e["seg0_top8_logp"][step]).max()))
            token = greedy_choice(logp, step, min_len, c)
            picked.append(token)
            if c.is_stop(token):
                break
            logits, key, value = llm.decode_step(llm.token_embedding(token), key, value)
    MEASURED[f"greedy_{case}"] = err
    assert picked == e["seg0_llm_picked"].tolist()
    assert err <= LOGP_ATOL, err
    result = llm.greedy_decode(lm_input, min_len, max_len)
    assert result.tokens == e["seg0_llm_tokens"].tolist()
    assert result.stop_token == int(e["seg0_llm_stop_id"])


@pytest.mark.parametrize("case", ["zero_shot_1", "cross_lingual_1", "instruct2_1"])
def test_teacher_forced(llm: CosyVoice3LM, cv3_vectors: Path, case: str) -> None:
    """Parallel teacher forcing over lm_input ++ recorded tokens, and the same through the KV cache, vs tf_logp."""
    g = np.load(cv3_vectors / "llm.npz")
    recorded = torch.as_tensor(g["recorded_tokens"])
    lm_input = torch.as_tensor(g[f"{case}_lm_input"])
    with torch.no_grad():
        # parallel: one causal pass; logits of the last position are returned, so walk prefixes through the cache
        logits, key, value = llm.prefill(lm_input)
        rows = [torch.log_softmax(logits[0], -1)]
        for tok in recorded.tolist():
            logits, key, value = llm.decode_step(llm.token_embedding(tok), key, value)
            rows.append(torch.log_softmax(logits[0], -1))
        cached = torch.stack(rows).numpy()
    err = float(np.abs(cached - g[f"{case}_tf_logp"]).max())
    MEASURED[f"tf_{case}"] = err
    assert err <= LOGP_ATOL, err
    np.testing.assert_allclose(cached[np.arange(24), g["recorded_tokens"]], g[f"{case}_tf_logp_of_recorded"],
                               atol=LOGP_ATOL)


def test_teacher_forced_parallel_hidden(llm: CosyVoice3LM, cv3_vectors: Path) -> None:
    """One causal pass over the whole sequence (no cache): hidden states after the final norm vs tf_hidden."""
    g = np.load(cv3_vectors / "llm.npz")
    lm_input = torch.as_tensor(g["zero_shot_1_lm_input"])
    seq = torch.cat([lm_input, llm.speech_embedding(torch.as_tensor(g["recorded_tokens"]))[None]], dim=1)
    body = llm.body
    with torch.no_grad():
        n = seq.shape[1]
        pos = torch.arange(n)[None]
        freqs = pos.float().unsqueeze(-1) * llm.inv_freq
        ang = torch.cat((freqs, freqs), -1).unsqueeze(1)
        allowed = (torch.arange(n)[None, :] <= torch.arange(n)[:, None])[None, None, None]
        x = seq
        for layer in body.layers:
            x, _, _ = layer(x, ang.cos(), ang.sin(), allowed, None, None)
        hidden = body.norm(x)[0, lm_input.shape[1] - 1:].numpy()
    err = float(np.abs(hidden - g["zero_shot_1_tf_hidden"]).max())
    MEASURED["tf_hidden_parallel"] = err
    assert err <= LOGP_ATOL, err


def test_max_len_run(llm: CosyVoice3LM, cv3_vectors: Path) -> None:
    g = np.load(cv3_vectors / "llm.npz")
    e = np.load(cv3_vectors / "e2e_zero_shot_3.npz")
    text = g["maxlen_text_token"]
    with torch.no_grad():
        lm_input = llm.lm_input(text, e["seg0_prompt_text_token"], e["seg0_llm_prompt_speech_token"])
        n = text.shape[1]
        result = llm.greedy_decode(lm_input, 2 * n, 2 * n)
    assert result.tokens == g["maxlen_tokens"].tolist() and result.stop_token == -1


def test_min_len_quirk(llm: CosyVoice3LM, cv3_vectors: Path) -> None:
    g = np.load(cv3_vectors / "llm.npz")
    got = [greedy_choice(g[k], 0, 25, llm.config) for k in ("quirk_scores_a", "quirk_scores_b")]
    assert got == g["quirk_greedy_ignore_eos_true"].tolist() == [6562, 6562]


def test_report_measured() -> None:
    """Prints the measured maxima (pytest -s) for the parity report."""
    print({k: f"{v:.2e}" for k, v in sorted(MEASURED.items())})
