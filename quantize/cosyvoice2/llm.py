"""CosyVoice2 LLM stage (`Qwen2LM`): our own Qwen2 body, lm_input assembly, KV-cache decoding, ONNX export.

Why our own Qwen2 and not transformers: transformers 5.x attends wrongly in the official one-position KV-cache
decode call, and the exported graphs must be plain, shape-dynamic ONNX. Every size comes from the release
(`cosyvoice2.yaml` `llm:` entry + `CosyVoice-BlankEN/config.json`); the state-dict keys are the official ones, so
`llm.pt` loads strictly. The 151936-way text head (`llm.model.lm_head.weight`, tied to `embed_tokens` when the
config ties) is kept as a parameter only so that checkpoints round-trip; it is never computed.

Special ids (speech vocabulary V = speech_token_size + 3, 6564 for CosyVoice2): eos = speech_token_size (6561);
the stop set is {6561, 6562, 6563}; eos is masked to -inf while the step index < min_len; min_len / max_len are
int(n_text * 2) / int(n_text * 20), counted over the target text tokens only (prompt text excluded).
lm_input = [llm_embedding[0] (sos)] ++ embed_tokens(prompt_text ++ text) ++ [llm_embedding[1] (task_id)]
++ speech_embedding(prompt_speech_tokens). Decode step i feeds speech_embedding[token_{i-1}] at the next position.

ONNX graphs written by `export_llm` (opset 17, standard ops only, float32; the embedding tables are NOT inside:
the runtime gathers rows from `embedding_tables()` with numpy and feeds embeddings). Symbols: B batch, L prompt
length, P cached length, H hidden size, NL layers, KV key/value heads, D head dim, V speech vocabulary.

`llm_prefill.onnx`
  inputs   inputs_embeds   float32 [B, L, H]   the lm_input (padded rows may hold anything, e.g. zeros)
           attention_mask  int64   [B, L]      1 = real position, 0 = padding; right or left padding both work
  outputs  logits          float32 [B, V]      raw `llm_decoder` output (no log_softmax) at the LAST position whose
                                               mask is 1 in each row
           present_key     float32 [NL, B, KV, L, D]   RoPE already applied; one slot per input position
           present_value   float32 [NL, B, KV, L, D]
  Positions are cumsum(attention_mask) - 1 (so a left-padded row starts at 0 on its first real position).

`llm_decode.onnx`
  inputs   inputs_embeds   float32 [B, 1, H]   speech_embedding[previous token]
           past_key        float32 [NL, B, KV, P, D]   present_key of the previous call
           past_value      float32 [NL, B, KV, P, D]
           attention_mask  int64   [B, P + 1]  the mask of every cached slot, then 1 for the new position
           position_ids    int64   [B, 1]      number of real positions already in the cache for that row
  outputs  logits          float32 [B, V]
           present_key     float32 [NL, B, KV, P + 1, D]
           present_value   float32 [NL, B, KV, P + 1, D]

Greedy decoding with the graphs (batch 1, no padding): prefill with mask ones; then for step i = 0, 1, ...:
logits -> eos -inf if i < min_len -> argmax -> stop if in the stop set or i == max_len, else feed that token's
speech_embedding row with position_ids = L + i and mask ones(L + i + 1).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.release import Release, check_state

CHECKPOINT_NAME = "llm.pt"
QWEN2LM_TARGET = "cosyvoice.llm.llm.Qwen2LM"
PREFILL_NAME = "llm_prefill.onnx"
DECODE_NAME = "llm_decode.onnx"
ONNX_OPSET = 17


@dataclass(frozen=True)
class Qwen2Config:
    """The Qwen2 body sizes, read from `CosyVoice-BlankEN/config.json`."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> "Qwen2Config":
        name = "CosyVoice-BlankEN/config.json"
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            config = cls(
                hidden_size=hidden,
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            )
        except KeyError as exc:
            raise ReleaseError(f"{name}: missing key {exc.args[0]!r}") from None
        if config.num_heads % config.num_kv_heads:
            raise ReleaseError(f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ReleaseError(f"{name}: hidden_act {cfg['hidden_act']!r} is not supported (expected 'silu')")
        if cfg.get("use_sliding_window"):
            raise ReleaseError(f"{name}: use_sliding_window is not supported")
        if cfg.get("rope_scaling"):
            raise ReleaseError(f"{name}: rope_scaling is not supported")
        return config


@dataclass(frozen=True)
class LLMConfig:
    """Qwen2LM: the Qwen2 body plus the speech vocabulary and the official length rule."""
    qwen: Qwen2Config
    speech_token_size: int
    min_token_text_ratio: float = 2.0   # official `inference` defaults, not in the yaml
    max_token_text_ratio: float = 20.0

    @classmethod
    def from_release(cls, hparams: dict[str, Any], qwen_config: dict[str, Any]) -> "LLMConfig":
        llm = hparams["llm"]
        target = getattr(llm, "target", None)
        if target != QWEN2LM_TARGET:
            raise ReleaseError(f"cosyvoice2.yaml: llm is {target!r}, expected {QWEN2LM_TARGET!r}")
        qwen = Qwen2Config.from_json(qwen_config)
        for key in ("llm_input_size", "llm_output_size"):
            if int(llm[key]) != qwen.hidden_size:
                raise ReleaseError(f"cosyvoice2.yaml: llm {key} {llm[key]} differs from the Qwen2 hidden_size "
                                   f"{qwen.hidden_size}")
        return cls(qwen=qwen, speech_token_size=int(llm["speech_token_size"]))

    @property
    def speech_vocab(self) -> int:
        return self.speech_token_size + 3

    @property
    def eos(self) -> int:
        return self.speech_token_size

    @property
    def stop_ids(self) -> tuple[int, int, int]:
        return (self.speech_token_size, self.speech_token_size + 1, self.speech_token_size + 2)

    def min_max_len(self, n_text_tokens: int) -> tuple[int, int]:
        """Length limits of the generated speech tokens, from the target text length (prompt text excluded)."""
        return int(n_text_tokens * self.min_token_text_ratio), int(n_text_tokens * self.max_token_text_ratio)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Qwen2Attention(nn.Module):
    """Grouped-query attention: queries are grouped per key/value head, so K/V are never repeated."""

    def __init__(self, c: Qwen2Config) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=True)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=True)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=True)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor,
                past_key: torch.Tensor | None, past_value: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.c
        b, n = x.shape[0], x.shape[1]
        q = self.q_proj(x).reshape(b, n, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).reshape(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).reshape(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past_key is not None:
            k = torch.cat((past_key, k), dim=2)
            v = torch.cat((past_value, v), dim=2)
        group = c.num_heads // c.num_kv_heads
        qg = q.reshape(b, c.num_kv_heads, group, n, c.head_dim)           # head h -> kv head h // group
        scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * (1.0 / math.sqrt(c.head_dim))
        # `where`, not an additive -inf: a fully padded query row stays finite instead of NaN.
        scores = torch.where(allowed, scores, torch.finfo(scores.dtype).min)
        out = torch.matmul(torch.softmax(scores, dim=-1), v.unsqueeze(2))  # [b, kv, group, n, d]
        out = out.reshape(b, c.num_heads, n, c.head_dim).transpose(1, 2).reshape(b, n, c.num_heads * c.head_dim)
        return self.o_proj(out), k, v


class Qwen2MLP(nn.Module):
    def __init__(self, c: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, c: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(c)
        self.mlp = Qwen2MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor,
                past_key: torch.Tensor | None, past_value: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, allowed, past_key, past_value)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class Qwen2Body(nn.Module):
    """`llm.model.model`: text embedding table, decoder layers, final norm."""

    def __init__(self, c: Qwen2Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class TextHead(nn.Module):
    """`llm.model.lm_head`: held only so that official checkpoints load strictly; never computed."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class Qwen2CausalLM(nn.Module):
    """`llm.model`: the Hugging Face Qwen2ForCausalLM layout (body + text head)."""

    def __init__(self, c: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Body(c)
        head = self.model.embed_tokens.weight if c.tie_word_embeddings else \
            nn.Parameter(torch.empty(c.vocab_size, c.hidden_size).normal_(0.0, 0.02))
        self.lm_head = TextHead(head)


class Qwen2Encoder(nn.Module):
    """`llm`: the official wrapper around Qwen2ForCausalLM."""

    def __init__(self, c: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2CausalLM(c)


@dataclass(frozen=True)
class GreedyResult:
    tokens: list[int]       # generated speech tokens, stop token excluded
    stop_token: int         # the id that ended decoding, -1 if max_len was reached


class Qwen2LM(nn.Module):
    """CosyVoice2 text-speech LM. `forward` is the shared causal pass used by prefill, decode and both graphs."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        self.config = config
        c = config.qwen
        self.llm_embedding = nn.Embedding(2, c.hidden_size)
        self.llm = Qwen2Encoder(c)
        self.speech_embedding = nn.Embedding(config.speech_vocab, c.hidden_size)
        self.llm_decoder = nn.Linear(c.hidden_size, config.speech_vocab, bias=True)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def body(self) -> Qwen2Body:
        return self.llm.model.model

    def lm_input(self, text: Sequence[int], prompt_text: Sequence[int] = (),
                 prompt_speech: Sequence[int] = ()) -> torch.Tensor:
        """[1, L, H]: sos, prompt_text ++ text, task_id, prompt speech tokens (official order)."""
        ids = torch.as_tensor(np.concatenate([np.asarray(prompt_text, np.int64).reshape(-1),
                                              np.asarray(text, np.int64).reshape(-1)]))
        speech = torch.as_tensor(np.asarray(prompt_speech, np.int64).reshape(-1))
        w = self.llm_embedding.weight
        rows = [w[0:1], self.body.embed_tokens(ids), w[1:2], self.speech_embedding(speech)]
        return torch.cat(rows, dim=0).unsqueeze(0)

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                past_key: torch.Tensor | None = None, past_value: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Causal pass over new positions after an optional cache.

        inputs_embeds [B, n, H]; attention_mask [B, P + n] (int, 1 = real); position_ids [B, n];
        past_key/past_value [NL, B, KV, P, D] or None. Returns speech logits [B, V] of the last real new
        position and the stacked caches [NL, B, KV, P + n, D].
        """
        n = inputs_embeds.shape[1]
        total = attention_mask.shape[1]
        past = total - n
        key_pos = torch.arange(total, device=inputs_embeds.device)
        query_pos = torch.arange(n, device=inputs_embeds.device) + past
        causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)                      # [n, T]
        allowed = (causal.unsqueeze(0) & (attention_mask.unsqueeze(1) != 0))[:, None, None]  # [B,1,1,n,T]

        freqs = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq          # [B, n, D/2]
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)                       # [B, 1, n, D]
        cos, sin = angles.cos(), angles.sin()

        x = inputs_embeds
        keys, values = [], []
        for i, layer in enumerate(self.body.layers):
            pk = past_key[i] if past_key is not None else None
            pv = past_value[i] if past_value is not None else None
            x, k, v = layer(x, cos, sin, allowed, pk, pv)
            keys.append(k)
            values.append(v)

        # last new position whose mask is 1 (right or left padding alike)
        new_mask = attention_mask[:, past:].to(torch.float32)  # float ArgMax: supported by every execution provider
        last = (new_mask * torch.arange(n, device=new_mask.device, dtype=torch.float32)).argmax(dim=1)
        h = torch.gather(x, 1, last.reshape(-1, 1, 1).expand(-1, 1, x.shape[2])).reshape(-1, x.shape[2])
        logits = self.llm_decoder(self.body.norm(h))
        c = self.config.qwen
        shape = (c.num_layers, x.shape[0], c.num_kv_heads, total, c.head_dim)  # static sizes stay static in ONNX
        return logits, torch.stack(keys).reshape(shape), torch.stack(values).reshape(shape)

    def prefill(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full causal pass over lm_input: (logits [B, V], present_key, present_value)."""
        if attention_mask is None:
            attention_mask = torch.ones(inputs_embeds.shape[:2], dtype=torch.int64)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        return self.forward(inputs_embeds, attention_mask, position_ids)

    def decode_step(self, inputs_embeds: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One new position [B, 1, H] after the cache; unpadded defaults: mask ones, position P."""
        b, p = inputs_embeds.shape[0], past_key.shape[3]
        if attention_mask is None:
            attention_mask = torch.ones(b, p + 1, dtype=torch.int64)
        if position_ids is None:
            position_ids = torch.full((b, 1), p, dtype=torch.int64)
        return self.forward(inputs_embeds, attention_mask, position_ids, past_key, past_value)

    def token_embedding(self, token: int) -> torch.Tensor:
        """[1, 1, H]: the decode-step input for a generated speech token."""
        return self.speech_embedding.weight[token].reshape(1, 1, -1)

    @torch.no_grad()
    def greedy_decode(self, lm_input: torch.Tensor, min_len: int, max_len: int) -> GreedyResult:
        """Argmax decoding under the official eos rule (batch 1)."""
        logits, key, value = self.prefill(lm_input)
        tokens: list[int] = []
        for step in range(max_len):
            token = greedy_choice(logits[0].numpy(), step, min_len, self.config)
            if token in self.config.stop_ids:
                return GreedyResult(tokens, token)
            tokens.append(token)
            logits, key, value = self.decode_step(self.token_embedding(token), key, value)
        return GreedyResult(tokens, -1)


def greedy_choice(logits: np.ndarray, step: int, min_len: int, config: LLMConfig) -> int:
    """Official greedy rule on one row of speech logits: eos masked while step < min_len, first max wins."""
    scores = np.array(logits, dtype=np.float32)
    if step < min_len:
        scores[config.eos] = -np.inf
    return int(np.argmax(scores))


def build_llm_random(hparams: dict[str, Any], qwen_config: dict[str, Any]) -> Qwen2LM:
    """The module from hyper-parameters alone, random weights (for random-weight full-size releases)."""
    return Qwen2LM(LLMConfig.from_release(hparams, qwen_config)).eval()


def load_llm_state(module: Qwen2LM, state: dict[str, torch.Tensor], file_name: str = CHECKPOINT_NAME) -> None:
    """Strict load: every official key with its shape, nothing else (ReleaseError naming file and key)."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    check_state(state, expected, file_name)
    module.load_state_dict(state, strict=True)


def build_llm(release: Release) -> Qwen2LM:
    """The module with the release's `llm.pt` weights (float16 or float32 on disk, float32 here)."""
    module = build_llm_random(release.hparams, release.qwen_config)
    load_llm_state(module, release.checkpoint(CHECKPOINT_NAME))
    return module


def embedding_tables(module: Qwen2LM) -> dict[str, np.ndarray]:
    """float32 tables the runtime gathers from: embed_tokens [text vocab, H], speech_embedding [V, H],
    llm_embedding [2, H] (row 0 sos, row 1 task_id)."""
    return {
        "embed_tokens": module.body.embed_tokens.weight.detach().cpu().numpy().astype(np.float32),
        "speech_embedding": module.speech_embedding.weight.detach().cpu().numpy().astype(np.float32),
        "llm_embedding": module.llm_embedding.weight.detach().cpu().numpy().astype(np.float32),
    }


class PrefillGraph(nn.Module):
    """Export wrapper: (inputs_embeds, attention_mask) -> (logits, present_key, present_value)."""

    def __init__(self, lm: Qwen2LM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.lm.prefill(inputs_embeds, attention_mask)


class DecodeGraph(nn.Module):
    """Export wrapper: (inputs_embeds, past_key, past_value, attention_mask, position_ids) -> (logits, present_*)."""

    def __init__(self, lm: Qwen2LM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, inputs_embeds: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor,
                attention_mask: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.lm.forward(inputs_embeds, attention_mask, position_ids, past_key, past_value)


def export_llm(module: Qwen2LM, out_dir: Path) -> dict[str, Path]:
    """Write llm_prefill.onnx and llm_decode.onnx (signatures in the module docstring) into out_dir.

    Traced with the TorchScript exporter (no onnxscript needed); example shapes use B = 2 and distinct
    lengths so that no dynamic dimension is specialised. Each graph carries its own copy of the weights.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    module = module.eval()
    c = module.config.qwen
    b, n, p = 2, 5, 3
    embeds = torch.randn(b, n, c.hidden_size)
    mask = torch.ones(b, n, dtype=torch.int64)
    cache = torch.randn(c.num_layers, b, c.num_kv_heads, p, c.head_dim)
    cache_axes = {1: "batch", 3: "past"}
    present_axes = {1: "batch", 3: "total"}
    jobs = {
        "llm_prefill": (
            PrefillGraph(module), (embeds, mask), ["inputs_embeds", "attention_mask"],
            {"inputs_embeds": {0: "batch", 1: "length"}, "attention_mask": {0: "batch", 1: "length"},
             "logits": {0: "batch"}, "present_key": present_axes, "present_value": present_axes}),
        "llm_decode": (
            DecodeGraph(module),
            (embeds[:, :1], cache, cache.clone(), torch.ones(b, p + 1, dtype=torch.int64),
             torch.full((b, 1), p, dtype=torch.int64)),
            ["inputs_embeds", "past_key", "past_value", "attention_mask", "position_ids"],
            {"inputs_embeds": {0: "batch"}, "past_key": cache_axes, "past_value": cache_axes,
             "attention_mask": {0: "batch", 1: "total"}, "position_ids": {0: "batch"},
             "logits": {0: "batch"}, "present_key": present_axes, "present_value": present_axes}),
    }
    paths: dict[str, Path] = {}
    for name, (graph, args, input_names, axes) in jobs.items():
        path = out_dir / f"{name}.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notices
            torch.onnx.export(graph, args, str(path), dynamo=False, opset_version=ONNX_OPSET,
                              input_names=input_names, output_names=["logits", "present_key", "present_value"],
                              dynamic_axes=axes, do_constant_folding=True)
        paths[name] = path
    return paths
