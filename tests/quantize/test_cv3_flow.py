"""Fun-CosyVoice3 flow (CausalMaskedDiffWithDiT: PreLookaheadLayer + DiT + CFM) against the official goldens
(cosyvoice3-tiny/vectors: flow.npz, e2e_*.npz, streaming.npz, noise.npz).

Tolerances (vectors/README.md section 7): embeddings / cond / masks exact; h, mu, spks abs 1e-5; DiT outputs,
Euler trajectory and mel abs 1e-4 (observed < 1e-6 on this tiny model; grows with width and depth).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.flow import cosine_t_span
from cosyedge.quantize.cosyvoice3.flow import (CausalMaskedDiffWithDiT, Flow3Config, build_flow, build_flow_random,
                                               fixed_noise, prompt_condition)
from cosyedge.quantize.cosyvoice3.release import Release3, open_release
from goldentools import Measured

CASES = [f"{mode}_{i}" for mode in ("zero_shot", "cross_lingual", "instruct2") for i in (1, 2, 3)]
H_ATOL = 1e-5
MEL_ATOL = 1e-4
MEASURED = Measured()
_err = MEASURED.err


@pytest.fixture(scope="module")
def flow(cv3_release: Release3) -> CausalMaskedDiffWithDiT:
    return build_flow(cv3_release)


@pytest.fixture(scope="module")
def noise() -> torch.Tensor:
    return torch.from_numpy(fixed_noise())


def test_sizes_from_yaml(cv3_tiny_dir: Path) -> None:
    c = Flow3Config.from_hparams(open_release(cv3_tiny_dir).hparams)
    assert (c.pre_lookahead_channels, c.estimator.dim, c.estimator.depth, c.estimator.heads) == (32, 64, 2, 4)
    assert (c.token_mel_ratio, c.pre_lookahead_len, c.estimator.static_chunk_size) == (2, 3, 50)


def test_noise_and_schedule(cv3_vectors: Path, noise: torch.Tensor) -> None:
    n = np.load(cv3_vectors / "noise.npz")["cfm_rand_noise"]
    np.testing.assert_array_equal(noise[:, :, :n.shape[2]].numpy(), n)
    np.testing.assert_allclose(cosine_t_span().numpy(), np.load(cv3_vectors / "flow.npz")["t_span"], atol=1e-7, rtol=0)


def test_rope(flow: CausalMaskedDiffWithDiT, cv3_vectors: Path) -> None:
    g = np.load(cv3_vectors / "flow.npz")
    rope = flow.decoder.estimator.rotary_embed
    np.testing.assert_array_equal(rope.inv_freq.numpy(), g["rope_inv_freq"])
    assert _err("rope_freqs", rope(248)[None], g["full_est_rope_freqs"]) <= 1e-6


@pytest.mark.parametrize("mode", ["full", "stream"])
def test_single_estimator_calls(flow: CausalMaskedDiffWithDiT, cv3_vectors: Path, mode: str) -> None:
    """est0 / est5 / est9 of the Euler loop, with the full or the chunk-causal mask; est5 internals."""
    g = np.load(cv3_vectors / "flow.npz")
    est = flow.decoder.estimator
    streaming = torch.tensor([int(mode == "stream")])
    base = {k: torch.as_tensor(g[f"{mode}_est0_{k}"]) for k in ("mask", "mu", "spks", "cond")}
    with torch.no_grad():
        for call in ("est0", "est5", "est9"):
            if f"{mode}_{call}_x" in g.files:
                x, t = torch.as_tensor(g[f"{mode}_{call}_x"]), torch.as_tensor(g[f"{mode}_{call}_t"])
            else:  # est9: its input is the 10th point of the trajectory
                x = torch.as_tensor(g[f"{mode}_x_traj"][9:10]).expand(2, -1, -1)
                t = torch.full((2,), float(g["t_span"][9]))
            out = est(x, base["mask"], base["mu"], t, base["spks"], base["cond"], streaming)
            assert _err(f"{mode}_{call}_out", out, g[f"{mode}_{call}_out"]) <= MEL_ATOL
        if mode == "full":
            x, t = torch.as_tensor(g["full_est5_x"]), torch.as_tensor(g["full_est5_t"])
            temb = est.time_embed(t)
            assert _err("est5_t_emb", temb, g["full_est5_t_emb"]) <= MEL_ATOL
            h = est.input_embed(x.transpose(1, 2), base["cond"].transpose(1, 2), base["mu"].transpose(1, 2),
                                base["spks"])
            assert _err("est5_input_embed", h, g["full_est5_input_embed"]) <= MEL_ATOL
            rope = est.rotary_embed(x.shape[2])
            visible = torch.ones(1, 1, x.shape[2], x.shape[2], dtype=torch.bool)
            for i, block in enumerate(est.transformer_blocks):
                h = block(h, temb, rope, visible)
                assert _err(f"est5_block{i}", h, g[f"full_est5_block{i}"]) <= MEL_ATOL
            assert _err("est5_norm_out", est.norm_out(h, temb), g["full_est5_norm_out"]) <= MEL_ATOL


def test_stream_mask_is_chunk_causal(cv3_vectors: Path) -> None:
    g = np.load(cv3_vectors / "flow.npz")
    mask = g["stream_est_attn_mask"]
    size = mask.shape[-1]
    i, j = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    np.testing.assert_array_equal(mask.reshape(-1, size, size)[0], j < (i // 50 + 1) * 50)


@pytest.mark.parametrize("mode", ["full", "stream"])
def test_full_solve(flow: CausalMaskedDiffWithDiT, cv3_vectors: Path, noise: torch.Tensor, mode: str) -> None:
    """zero_shot_1 inputs: tokens -> embedding -> h -> mu, spks, cond -> Euler trajectory -> mel."""
    g = np.load(cv3_vectors / "flow.npz")
    e = np.load(cv3_vectors / "e2e_zero_shot_1.npz")
    streaming = torch.tensor([int(mode == "stream")])
    token = torch.cat([torch.as_tensor(e["seg0_flow_prompt_speech_token"]), torch.as_tensor(e["seg0_flow_tokens"]),
                       torch.zeros(1, 3, dtype=torch.int32)], dim=1).long()
    np.testing.assert_array_equal(token[:, :-3].numpy(), g["full_token_all"])
    with torch.no_grad():
        np.testing.assert_array_equal(flow.input_embedding(token[:, :-3]).numpy(), g["full_token_emb"])
        h = flow.prelookahead(token, torch.tensor([1]))
        assert _err("h_prelookahead", h, g["full_h_prelookahead"]) <= H_ATOL
        mu, spks = flow.encode(token, torch.as_tensor(e["seg0_flow_embedding"]), torch.tensor([1]), streaming)
        assert _err("mu", mu, g["full_mu"]) <= H_ATOL
        assert _err("spks", spks, g["full_spks"]) <= H_ATOL
        cond = prompt_condition(torch.as_tensor(e["seg0_prompt_speech_feat"]), mu.shape[2])
        np.testing.assert_array_equal(cond.numpy(), g["full_cond"])
        x = flow.solve(mu, spks, cond, noise, streaming)
        assert _err(f"{mode}_x_traj_final", x[0], g[f"{mode}_x_traj"][10]) <= MEL_ATOL
        mel = flow.inference(torch.as_tensor(e["seg0_flow_tokens"]), torch.as_tensor(e["seg0_flow_prompt_speech_token"]),
                             torch.as_tensor(e["seg0_prompt_speech_feat"]), torch.as_tensor(e["seg0_flow_embedding"]),
                             noise, streaming=mode == "stream", finalize=True)
    assert _err(f"{mode}_mel", mel, g[f"{mode}_mel"]) <= MEL_ATOL


@pytest.mark.parametrize("case", CASES)
def test_e2e_flow(flow: CausalMaskedDiffWithDiT, cv3_vectors: Path, noise: torch.Tensor, case: str) -> None:
    e = np.load(cv3_vectors / f"e2e_{case}.npz")
    args = [torch.as_tensor(e[k]) for k in ("seg0_flow_tokens", "seg0_flow_prompt_speech_token",
                                            "seg0_prompt_speech_feat", "seg0_flow_embedding")]
    with torch.no_grad():
        token = torch.cat([args[1], args[0], torch.zeros(1, 3, dtype=torch.int32)], dim=1).long()
        assert _err("e2e_h", flow.prelookahead(token, torch.tensor([1])), e["seg0_h_prelookahead"]) <= H_ATOL
        assert _err("e2e_spks", flow.speaker(args[3]), e["seg0_spks"]) <= H_ATOL
        mel = flow.inference(*args, noise, streaming=False, finalize=True)
    assert _err("e2e_mel", mel, e["seg0_mel"]) <= MEL_ATOL


@pytest.mark.parametrize("run", ["scripted", "instruct2_3"])
def test_streaming_chunks(flow: CausalMaskedDiffWithDiT, cv3_vectors: Path, noise: torch.Tensor, run: str) -> None:
    """Each chunk re-runs the flow on tokens[:n] (streaming chunk-causal mask, finalize False: the last 3 tokens
    are look-ahead only); the last chunk runs with finalize True and streaming False, as the official loop does."""
    s = np.load(cv3_vectors / "streaming.npz")
    chunks = json.loads((cv3_vectors / "meta.json").read_text())["files"]["streaming.npz"][run]["chunks"]
    tokens = torch.as_tensor(s[f"{run}_flow_tokens"])
    prompt = [torch.as_tensor(s[f"{run}_{k}"]) for k in ("flow_prompt_speech_token", "prompt_speech_feat",
                                                         "flow_embedding")]
    with torch.no_grad():
        for i, chunk in enumerate(chunks):
            mel = flow.inference(tokens[:, :chunk["n_tokens"]], *prompt, noise, streaming=chunk["streaming"],
                                 finalize=chunk["finalize"])
            assert mel.shape[2] == chunk["flow_mel_frames"]
            assert _err("stream_chunk_mel", mel, s[f"{run}_chunk{i}_flow_mel"]) <= MEL_ATOL
        # the first DiT call of chunk 0 (chunk-causal mask)
        est = {k: torch.as_tensor(s[f"{run}_chunk0_est0_{k}"]) for k in ("x", "mask", "mu", "t", "spks", "cond", "out")}
        out = flow.decoder.estimator(est["x"], est["mask"], est["mu"], est["t"], est["spks"], est["cond"],
                                     torch.tensor([1]))
        assert _err("stream_chunk0_est0", out, est["out"].numpy()) <= MEL_ATOL
        if run == "scripted":   # the chunk mask changes the result: streaming != non-streaming
            full = flow.inference(tokens, *prompt, noise, streaming=False, finalize=True)
            assert _err("scripted_nonstream_mel", full, s["scripted_nonstream_mel"]) <= MEL_ATOL


def test_strict_load_names_key(cv3_tiny_dir: Path) -> None:
    release = open_release(cv3_tiny_dir)
    module = build_flow_random(release.hparams)
    state = release.checkpoint("flow.pt")
    state.pop("decoder.estimator.rotary_embed.inv_freq")
    with pytest.raises(ReleaseError, match=r"flow\.pt: missing key 'decoder\.estimator\.rotary_embed\.inv_freq'"):
        from cosyedge.quantize.cosyvoice3.flow import load_flow_state
        load_flow_state(module, state)


def test_report_measured() -> None:
    print({k: f"{v:.2e}" for k, v in sorted(MEASURED.items())})
