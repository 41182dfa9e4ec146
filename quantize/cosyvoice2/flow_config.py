"""CosyVoice2 flow sizes, read from the release's `cosyvoice2.yaml` `flow:` entry alone, and the chunk mask they set.

One parser builds both the tiny test release and CosyVoice2-0.5B; every option the official code could take but
our modules do not implement (another input layer, positional encoding, solver, activation, UNet depth) is
refused here with a ReleaseError naming the yaml key, instead of producing a silently different network.

`attention_visible` lives beside the sizes because both attention stacks (the encoder's Conformer blocks and the
estimator's transformer blocks) derive their streaming visibility from the `static_chunk_size` values parsed here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cosyedge.device.errors import ReleaseError

FLOW_TARGET = "cosyvoice.flow.flow.CausalMaskedDiffWithXvec"


@dataclass(frozen=True)
class EncoderConfig:
    """UpsampleConformerEncoder sizes (yaml `flow.encoder`); channel counts inside are all `output_size`."""
    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    static_chunk_size: int


@dataclass(frozen=True)
class EstimatorConfig:
    """CausalConditionalDecoder sizes (yaml `flow.decoder.estimator`)."""
    in_channels: int
    out_channels: int
    channels: int
    attention_head_dim: int
    num_heads: int
    n_blocks: int
    num_mid_blocks: int
    static_chunk_size: int
    num_decoding_left_chunks: int


@dataclass(frozen=True)
class FlowSizes:
    """The sizes every CosyVoice flow (2 and 3) reads the same way from its yaml `flow:` entry, and the checks
    both make on that entry."""
    vocab_size: int
    input_size: int
    mel_bins: int
    spk_embed_dim: int
    token_mel_ratio: int
    pre_lookahead_len: int
    inference_cfg_rate: float

    @staticmethod
    def flow_entry(hparams: dict[str, Any], target: str, yaml_name: str) -> Any:
        """The yaml `flow:` entry, refused unless it is the class `target`."""
        flow = hparams.get("flow")
        if getattr(flow, "target", None) != target:
            raise ReleaseError(f"{yaml_name}: flow is {getattr(flow, 'target', None)!r}, expected {target!r}")
        return flow

    @staticmethod
    def check_cfm(cfm: Any, yaml_name: str) -> None:
        """Refuse a CFM solver or time schedule other than the ones implemented (Euler, cosine)."""
        for key, want in (("solver", "euler"), ("t_scheduler", "cosine")):
            if cfm.get(key, want) != want:
                raise ReleaseError(f"{yaml_name}: flow cfm_params {key} {cfm[key]!r} is not supported")

    @staticmethod
    def read(flow: Any, cfm: Any) -> dict[str, Any]:
        """The shared sizes as keyword arguments (KeyError / TypeError on a missing or odd entry)."""
        return {"vocab_size": int(flow["vocab_size"]), "input_size": int(flow["input_size"]),
                "mel_bins": int(flow["output_size"]), "spk_embed_dim": int(flow["spk_embed_dim"]),
                "token_mel_ratio": int(flow["token_mel_ratio"]), "pre_lookahead_len": int(flow["pre_lookahead_len"]),
                "inference_cfg_rate": float(cfm["inference_cfg_rate"])}


@dataclass(frozen=True)
class FlowConfig(FlowSizes):
    encoder: EncoderConfig
    estimator: EstimatorConfig

    @classmethod
    def from_hparams(cls, hparams: dict[str, Any]) -> "FlowConfig":
        flow = cls.flow_entry(hparams, FLOW_TARGET, "cosyvoice2.yaml")
        try:
            enc, dec = flow["encoder"], flow["decoder"]
            est, cfm = dec["estimator"], dec["cfm_params"]["content"]
            for key, want in (("input_layer", "linear"), ("pos_enc_layer_type", "rel_pos_espnet"),
                              ("selfattention_layer_type", "rel_selfattn"), ("normalize_before", True),
                              ("use_cnn_module", False), ("macaron_style", False)):
                if enc.get(key, want) != want:
                    raise ReleaseError(f"cosyvoice2.yaml: flow.encoder {key} {enc[key]!r} is not supported "
                                       f"(expected {want!r})")
            cls.check_cfm(cfm, "cosyvoice2.yaml")
            if est.get("act_fn", "gelu") != "gelu":
                raise ReleaseError(f"cosyvoice2.yaml: estimator act_fn {est['act_fn']!r} is not supported")
            channels = list(est["channels"])
            if len(channels) != 1:
                raise ReleaseError(f"cosyvoice2.yaml: estimator channels {channels} (only one UNet level, as in "
                                   "CosyVoice2, is supported)")
            return cls(
                **cls.read(flow, cfm),
                encoder=EncoderConfig(
                    input_size=int(enc["input_size"]), output_size=int(enc["output_size"]),
                    attention_heads=int(enc["attention_heads"]), linear_units=int(enc["linear_units"]),
                    num_blocks=int(enc["num_blocks"]), static_chunk_size=int(enc["static_chunk_size"])),
                estimator=EstimatorConfig(
                    in_channels=int(est["in_channels"]), out_channels=int(est["out_channels"]),
                    channels=int(channels[0]), attention_head_dim=int(est["attention_head_dim"]),
                    num_heads=int(est["num_heads"]), n_blocks=int(est["n_blocks"]),
                    num_mid_blocks=int(est["num_mid_blocks"]), static_chunk_size=int(est["static_chunk_size"]),
                    num_decoding_left_chunks=int(est["num_decoding_left_chunks"])),
            )
        except (KeyError, TypeError) as exc:
            raise ReleaseError(f"cosyvoice2.yaml: flow entry lacks {exc.args[0]!r}") from None


def attention_visible(size: torch.Tensor | int, chunk: int, streaming: torch.Tensor, left_chunks: int = -1,
                      past: torch.Tensor | int = 0) -> torch.Tensor:
    """[size, past + size] bool, query i x key j, the queries being the `size` frames after `past` frames already
    solved (the estimator's prompt state; 0 elsewhere). `streaming` (int64 [1]) 1: the official static chunk mask
    (i sees its own chunk and the `left_chunks` before it, every earlier one when negative); 0: everything."""
    keys = torch.arange(past + size)
    block = torch.div(torch.arange(size) + past, chunk, rounding_mode="floor").unsqueeze(1)
    visible = keys.unsqueeze(0) < (block + 1) * chunk
    if left_chunks >= 0:
        visible = visible & (keys.unsqueeze(0) >= torch.clamp(block - left_chunks, min=0) * chunk)
    return visible | (streaming == 0)
