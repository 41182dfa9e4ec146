"""GPU memory plan per device profile: weights, activations at the profile's max shapes, KV cache at max rows.

Estimates, stated as such (an engine's real footprint is known only after a build on the device): activations
count the largest tensors of one layer at the max shapes in fp16 (TensorRT reuses activation memory across
layers) and the attention scores, which grow with length squared and dominate the flow; the KV cache is float32
(graph I/O stays float32 for every precision), past and present both alive during a decode step, at the longest
prompt plus the most speech tokens the flow accepts. Weights are the graph files' sizes (or parameter counts x bytes for the full model).
The LLM is one graph (one engine, one copy of its weights) for the prefill and every decode step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cosyedge.device.bundle import Bundle
from cosyedge.device.errors import BundleError
from cosyedge.device.trt.device_profiles import DeviceProfile
from cosyedge.device.trt.profiles import CosyVoice2Bounds

MB = 1 << 20
FP16 = 2
FP32 = 4
FFN_RATIO = 4864 / 896  # Qwen2-0.5B intermediate / hidden
FLOW_HEADS, FLOW_CHANNELS, ENCODER_CHANNELS = 8, 256, 512  # CosyVoice2 estimator and Conformer encoder
HIFT_CHANNELS_X_UPSAMPLE = 64 * 120  # widest HiFT activation: 64 channels at 120 x the mel frame rate


@dataclass(frozen=True)
class ModelSizes:
    """What the plan needs from a CosyVoice model (either family): weight bytes per stage, the LLM's shape and the
    flow's widths (estimator attention heads and width, encoder width)."""
    label: str
    weights: dict[str, int]  # llm / flow / hift -> bytes on the GPU
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    config: dict  # manifest.config (the bounds' inputs)
    flow_heads: int = FLOW_HEADS
    flow_channels: int = FLOW_CHANNELS
    encoder_heads: int = FLOW_HEADS  # 0: no attention in the flow encoder (Fun-CosyVoice3)
    encoder_channels: int = ENCODER_CHANNELS

    @classmethod
    def from_bundle(cls, bundle: Bundle, selection: str) -> "ModelSizes":
        """Sizes of the graphs `selection` loads (file bytes), the LLM shape from the manifest's signatures and the
        flow widths from `manifest.config["flow_sizes"]` (CosyVoice2-0.5B's when a bundle predates the key)."""
        if bundle.manifest.family not in ("cosyvoice2", "cosyvoice3"):
            raise BundleError("the memory plan covers cosyvoice2 and cosyvoice3 bundles")
        graphs = bundle.selected(selection)
        weights = {"llm": 0, "flow": 0, "hift": 0}
        for name, component in graphs.items():
            stage = name.split("_")[0]
            if stage in weights:
                weights[stage] += bundle.path(component.file).stat().st_size
        inputs = {s.name: s.shape for s in graphs["llm"].inputs}
        hidden = inputs["inputs_embeds"][2]
        if "past_key" in inputs:                    # stacked caches [NL, B, KV, P, D]
            layers, kv, dim = (inputs["past_key"][i] for i in (0, 2, 4))
        else:                                       # the cpu targets' shared caches, one [B, KV, C, D] per layer
            layers = sum(name.startswith("past_key_") for name in inputs)
            kv, dim = inputs["past_key_0"][1], inputs["past_key_0"][3]
        flow = bundle.manifest.config.get("flow_sizes", {})
        return cls(f"{bundle.root.name} ({selection})", weights, int(layers), int(hidden), int(kv),
                   int(dim), dict(bundle.manifest.config), int(flow.get("estimator_heads", FLOW_HEADS)),
                   int(flow.get("estimator_width", FLOW_CHANNELS)), int(flow.get("encoder_heads", FLOW_HEADS)),
                   int(flow.get("encoder_width", ENCODER_CHANNELS)))


# CosyVoice2-0.5B, target trt-int8 (docs/bundle_cosyvoice2.md): LLM 494.0 M body in int8 + fp32 speech head
# (6564 x 896), once (one graph for prefill and decode); flow encoder 37.8 M fp16, estimator 71.3 M int8, rest
# 3.4 M fp16; HiFT 20.8 M, about 1 byte per weight (int8 decoder, fp32 source).
FULL_SIZE = ModelSizes("CosyVoice2-0.5B (trt-int8)",
                       {"llm": 494_000_000 + 6564 * 896 * FP32, "flow": 37_800_000 * FP16 + 71_300_000
                        + 3_400_000 * FP16, "hift": 20_800_000}, layers=24, hidden=896, kv_heads=2, head_dim=64,
                       config={"token_mel_ratio": 2, "pre_lookahead_len": 3, "hift_upsample": 480,
                               "mel": {"sample_rate": 24000, "hop": 480}, "max_prompt_seconds": 30,
                               "min_token_text_ratio": 2, "max_token_text_ratio": 20, "stream": {"mel_cache_frames": 8}})


def memory_plan(sizes: ModelSizes, device: DeviceProfile) -> list[dict[str, object]]:
    """One row per stage (llm, flow, hift) and a total, in MiB, with the device's budget and whether it fits."""
    frames, rows, flow_rows = device.max_frames, device.max_rows, device.flow_rows
    bounds = CosyVoice2Bounds.from_config(sizes.config, device)
    length, budget_tokens = bounds.prefill, bounds.budget
    heads = max(1, sizes.hidden // sizes.head_dim)
    ffn = math.ceil(FFN_RATIO * sizes.hidden)
    llm_act = max(rows * length * (4 * sizes.hidden + 2 * ffn) * FP16 + rows * heads * length * length * FP16,
                  rows * heads * (length + budget_tokens) * sizes.head_dim * 2 * FP16)  # prefill vs decode (GQA)
    kv = 2 * 2 * sizes.layers * rows * sizes.kv_heads * (length + budget_tokens) * sizes.head_dim * FP32
    cfg_rows = 2 * flow_rows
    flow_act = (cfg_rows * sizes.flow_heads * frames * frames * FP16 + 8 * cfg_rows * sizes.flow_channels * frames * FP16
                + sizes.encoder_heads * frames * frames * FP16 + 8 * sizes.encoder_channels * frames * FP16)  # + encoder
    hift_act = 3 * bounds.hift_frames * HIFT_CHANNELS_X_UPSAMPLE * FP16
    stages = [("llm", llm_act, kv), ("flow", flow_act, 0), ("hift", hift_act, 0)]
    table = [{"stage": stage, "weights_mb": round(sizes.weights[stage] / MB, 1), "activations_mb": round(act / MB, 1),
              "kv_cache_mb": round(cache / MB, 1), "total_mb": round((sizes.weights[stage] + act + cache) / MB, 1)}
             for stage, act, cache in stages]
    total = {key: round(sum(row[key] for row in table), 1)
             for key in ("weights_mb", "activations_mb", "kv_cache_mb", "total_mb")}
    workspace = device.workspace_mb
    table.append({"stage": "total (+ workspace)", **total, "total_mb": round(total["total_mb"] + workspace, 1),
                  "workspace_mb": workspace, "budget_mb": round(device.gpu_budget_gb * 1024, 1),
                  "fits": total["total_mb"] + workspace <= device.gpu_budget_gb * 1024})
    return table


def format_plan(sizes: ModelSizes, device: DeviceProfile) -> str:
    """A markdown table (the docs carry the same table for the full-size model)."""
    rows = memory_plan(sizes, device)
    lines = [f"{sizes.label} on {device.name} (max_frames {device.max_frames}, max_rows {device.max_rows}, "
             f"flow_rows {device.flow_rows}; MiB, estimates)", "",
             "| stage | weights | activations at max shapes | KV cache at max rows | total |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['stage']} | {row['weights_mb']} | {row['activations_mb']} | {row['kv_cache_mb']} | "
                     f"{row['total_mb']} |")
    last = rows[-1]
    lines.append("")
    lines.append(f"workspace {last['workspace_mb']} MiB included; budget {last['budget_mb']} MiB: "
                 f"{'fits' if last['fits'] else 'DOES NOT FIT'}")
    return "\n".join(lines)
