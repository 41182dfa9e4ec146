"""CosyVoice2 LLM stage (`Qwen2LM`): lm_input assembly, the shared causal pass, KV-cache greedy decoding.

The Qwen2 body it wraps is our own (llm_qwen2.py, why there). Every size comes from the release
(`cosyvoice2.yaml` `llm:` entry + `CosyVoice-BlankEN/config.json`); the state-dict keys are the official ones, so
`llm.pt` loads strictly. The 151936-way text head (`llm.model.lm_head.weight`, tied to `embed_tokens` when the
config ties) is kept as a parameter only so that checkpoints round-trip; it is never computed.

Special ids (speech vocabulary V = speech_token_size + 3, 6564 for CosyVoice2): eos = speech_token_size (6561);
the stop set is {6561, 6562, 6563}; eos is masked to -inf while the step index < min_len; min_len / max_len are
int(n_text * 2) / int(n_text * 20), counted over the target text tokens only (prompt text excluded).
lm_input = [llm_embedding[0] (sos)] ++ embed_tokens(prompt_text ++ text) ++ [llm_embedding[1] (task_id)]
++ speech_embedding(prompt_speech_tokens). Decode step i feeds speech_embedding[token_{i-1}] at the next position.

The ONNX graph (one for prefill and decode) and the embedding tables the runtime gathers from are in llm_export.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np
import torch
from torch import nn

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.llm_qwen2 import Qwen2Body, Qwen2Config, Qwen2Encoder
from cosyedge.quantize.cosyvoice2.release import Release, check_state

CHECKPOINT_NAME = "llm.pt"
QWEN2LM_TARGET = "cosyvoice.llm.llm.Qwen2LM"


@dataclass(frozen=True)
class LLMConfig:
    """Qwen2LM: the Qwen2 body plus the speech vocabulary and the official length rule."""
    qwen: Qwen2Config
    speech_token_size: int
    min_token_text_ratio: float = 2.0   # official `inference` defaults, not in the yaml
    max_token_text_ratio: float = 20.0
    # Family hooks (class attributes, overridden by CosyVoice3's subclass): the yaml class and file name, whether
    # `llm_decoder` has a bias, and where sos / task_id live (None: the separate 2-row `llm_embedding`).
    target: ClassVar[str] = QWEN2LM_TARGET
    yaml_name: ClassVar[str] = "cosyvoice2.yaml"
    decoder_bias: ClassVar[bool] = True
    sos_task_ids: ClassVar[tuple[int, int] | None] = None

    @classmethod
    def from_release(cls, hparams: dict[str, Any], qwen_config: dict[str, Any], **extra: Any) -> "LLMConfig":
        llm = hparams["llm"]
        target = getattr(llm, "target", None)
        if target != cls.target:
            raise ReleaseError(f"{cls.yaml_name}: llm is {target!r}, expected {cls.target!r}")
        qwen = Qwen2Config.from_json(qwen_config)
        for key in ("llm_input_size", "llm_output_size"):
            if int(llm[key]) != qwen.hidden_size:
                raise ReleaseError(f"{cls.yaml_name}: llm {key} {llm[key]} differs from the Qwen2 hidden_size "
                                   f"{qwen.hidden_size}")
        return cls(qwen=qwen, speech_token_size=int(llm["speech_token_size"]), **extra)

    @property
    def speech_vocab(self) -> int:
        return self.speech_token_size + 3

    @property
    def eos(self) -> int:
        return self.speech_token_size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.speech_token_size, self.speech_token_size + 1, self.speech_token_size + 2)

    @property
    def min_len_masked_id(self) -> int:
        """The id the official `sampling_ids` masks while step < min_len: always `speech_token_size` (eos in
        CosyVoice2; in CosyVoice3 it is sos, so the real eos is not blocked there - an official quirk)."""
        return self.speech_token_size

    def min_max_len(self, n_text_tokens: int) -> tuple[int, int]:
        """Length limits of the generated speech tokens, from the target text length (prompt text excluded)."""
        return int(n_text_tokens * self.min_token_text_ratio), int(n_text_tokens * self.max_token_text_ratio)


@dataclass(frozen=True)
class GreedyResult:
    tokens: list[int]       # generated speech tokens, stop token excluded
    stop_token: int         # the id that ended decoding, -1 if max_len was reached


class Qwen2LM(nn.Module):
    """CosyVoice2 text-speech LM. `forward` is the shared causal pass used by prefill, decode and the ONNX graph."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        self.config = config
        c = config.qwen
        if config.sos_task_ids is None:
            self.llm_embedding = nn.Embedding(2, c.hidden_size)
        self.llm = Qwen2Encoder(c)
        self.speech_embedding = nn.Embedding(config.speech_vocab, c.hidden_size)
        self.llm_decoder = nn.Linear(c.hidden_size, config.speech_vocab, bias=config.decoder_bias)
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
        if self.config.sos_task_ids is None:
            w = self.llm_embedding.weight
            sos, task = w[0:1], w[1:2]
        else:
            sos, task = (self.speech_embedding.weight[i:i + 1] for i in self.config.sos_task_ids)
        rows = [sos, self.body.embed_tokens(ids), task, self.speech_embedding(speech)]
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
        allowed, cos, sin = self.frame(inputs_embeds, attention_mask, position_ids)
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

    def frame(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What every layer of a causal pass shares: which keys each new position may see [B, 1, 1, n, P + n]
        (causal and real) and the rotary tables cos, sin [B, 1, n, D] of the new positions."""
        n = inputs_embeds.shape[1]
        total = attention_mask.shape[1]
        key_pos = torch.arange(total, device=inputs_embeds.device)
        query_pos = torch.arange(n, device=inputs_embeds.device) + (total - n)
        causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)                      # [n, T]
        allowed = (causal.unsqueeze(0) & (attention_mask.unsqueeze(1) != 0))[:, None, None]  # [B,1,1,n,T]
        freqs = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq          # [B, n, D/2]
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)                       # [B, 1, n, D]
        return allowed, angles.cos(), angles.sin()

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
    """Official greedy rule on one row of speech logits: `min_len_masked_id` (eos in CosyVoice2) masked while
    step < min_len, first max wins."""
    scores = np.array(logits, dtype=np.float32)
    if step < min_len:
        scores[config.min_len_masked_id] = -np.inf
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
