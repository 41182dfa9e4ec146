"""TensorRT optimisation profiles (min / opt / max shape of every dynamic input) for the graphs of a bundle.

Derived at load time from the manifest (graph signatures with symbolic dims, `manifest.config`) and a device
profile, not written into the manifest at quantize time: the same bundle serves an Orin Nano and an AGX Orin with
different limits, the service config may lower them, and the bundle stays hashed and unchanged (docs/jetson.md).

Each graph gets exactly one profile, so one engine serves every call: the one LLM graph's profile spans the
prefill (new positions up to the longest prompt, empty cache: past = 0) and every decode step (one new position,
every cache length a request can reach), so the growing cache never leaves it (without profiles the provider
rebuilds an engine whenever a shape leaves what it has seen). Its opt point is a decode step, the call that
dominates the LLM's time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from cosyedge.device.bundle import Bundle, Component
from cosyedge.device.errors import BundleError
from cosyedge.device.text import COSYVOICE_MAX_TOKENS, VITS_MAX_IDS
from cosyedge.device.trt.device_profiles import DeviceProfile

SPEED_MIN = 0.25  # SynthesisOptions speed floor: a stretched mel has up to 1/SPEED_MIN times the frames

Range = tuple[int, int, int]  # min, opt, max of one symbolic dimension


@dataclass(frozen=True)
class InputProfile:
    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def covers(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.min) and all(lo <= s <= hi for lo, s, hi in zip(self.min, shape, self.max))


@dataclass(frozen=True)
class GraphProfile:
    """The profile of one graph: its component (file, precision) and one InputProfile per dynamic input."""
    graph: str
    component: Component
    inputs: tuple[InputProfile, ...]

    def input(self, name: str) -> InputProfile | None:
        return next((i for i in self.inputs if i.name == name), None)

    def shapes(self, which: str) -> str:
        """`name:d0xd1,...` for which = min / opt / max (the TensorRT provider's and trtexec's syntax)."""
        return ",".join(f"{i.name}:{'x'.join(str(d) for d in getattr(i, which))}" for i in self.inputs)


def _clamp(opt: int, low: int, high: int) -> Range:
    return low, max(low, min(opt, high)), high


@dataclass(frozen=True)
class CosyVoice2Bounds:
    """The longest inputs one CosyVoice request (either family) can give each graph on a device (shared with the
    memory plan).

    The flow voices at most `budget` = max_frames // token_mel_ratio speech tokens (prompt + generated). A target
    text yields at least min_token_text_ratio speech tokens per text token, so longer texts are refused by the
    flow anyway; a prompt transcript has fewer tokens than its speech (25 per second). The decode cache may grow
    by max_token_text_ratio tokens per text token (the official stopping rule) before the flow refuses. HiFT gets
    at most the whole utterance's mel (stretched by a speed below 1) plus a streaming mel cache (CosyVoice2: the
    last `mel_cache_frames` of the previous chunk; Fun-CosyVoice3 has none: it re-runs on the accumulated mel).
    """
    budget: int
    prompt_speech: int
    prefill: int
    cache: int
    lookahead: int
    upsample: int
    hift_frames: int

    @classmethod
    def from_config(cls, c: dict[str, Any], d: DeviceProfile) -> "CosyVoice2Bounds":
        try:
            ratio, lookahead, upsample = int(c["token_mel_ratio"]), int(c["pre_lookahead_len"]), int(c["hift_upsample"])
            token_rate = c["mel"]["sample_rate"] / c["mel"]["hop"] / ratio
            prompt_seconds = float(c["max_prompt_seconds"])
            min_ratio, max_ratio = float(c["min_token_text_ratio"]), float(c["max_token_text_ratio"])
            mel_cache = int(c["stream"].get("mel_cache_frames", 0))
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise BundleError(f"manifest config lacks what the TensorRT profiles need ({type(exc).__name__}: "
                              f"{exc})") from None
        budget = d.max_frames // ratio
        prompt_speech = min(budget, math.ceil(prompt_seconds * token_rate))
        text = max(math.ceil(budget / max(min_ratio, 1.0)), COSYVOICE_MAX_TOKENS)  # a segment's bound: always covered
        prefill = 2 + text + 2 * prompt_speech  # sos + target text + prompt text + task id + prompt speech
        return cls(budget, prompt_speech, prefill, prefill + math.ceil(max_ratio * text), lookahead, upsample,
                   math.ceil(d.max_frames / SPEED_MIN) + mel_cache)  # speed < 1 stretches the mel HiFT gets


def _cosyvoice2_ranges(c: dict[str, Any], d: DeviceProfile) -> dict[str, dict[str, Range]]:
    """CosyVoice2 (bounds: CosyVoice2Bounds). Batch rows: the LLM prefills and decodes up to `max_rows` rows, the
    estimator runs 2 x `flow_rows` (classifier-free guidance), HiFT one row at a time."""
    b = CosyVoice2Bounds.from_config(c, d)
    rows = d.max_rows
    hift = {"B": (1, 1, 1), "T": _clamp(200, 1, b.hift_frames),
            "TU": _clamp(200 * b.upsample, b.upsample, b.hift_frames * b.upsample)}
    return {
        "llm": {"batch": (1, 1, rows), "length": (1, 1, b.prefill), "past": _clamp(512, 0, b.cache),
                "total": _clamp(513, 1, b.cache + 1)},
        "flow_encoder": {"tokens": _clamp(256, 1, b.budget + b.lookahead)},
        # the prompt state (cosyvoice2/prompt_cache.py): none past by default, up to a prompt's whole chunks; its
        # int8 form (q_rows, past_q) only in an fp32 graph (the fp16 and trt-int8 graphs drop those inputs)
        "flow_estimator": {"batch": (2, 2, 2 * d.flow_rows), "frames": _clamp(500, 1, d.max_frames),
                           "state_rows": (1, 2, 2 * d.flow_rows), "past": _clamp(150, 0, d.max_frames),
                           "q_rows": (1, 2, 2 * d.flow_rows), "past_q": _clamp(150, 0, d.max_frames)},
        "hift_source": hift,
        "hift_decoder": hift,
    }


def _cosyvoice3_ranges(c: dict[str, Any], d: DeviceProfile) -> dict[str, dict[str, Range]]:
    """Fun-CosyVoice3: CosyVoice2's rules (the same LLM, flow and HiFT symbols and bounds, read from its own
    manifest), plus the fixed sine-noise rows `hift_source` reads: L = T x U, one row per output sample, at most
    the release's noise tensor (`hift_noise.max_rows`, 300 s: the vocoder refuses longer), which bounds T too."""
    ranges = _cosyvoice2_ranges(c, d)
    try:
        upsample, rows = int(c["hift_upsample"]), int(c["hift_noise"]["max_rows"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"manifest config lacks what the TensorRT profiles need ({type(exc).__name__}: "
                          f"{exc})") from None
    lo, opt, hi = ranges["hift_source"]["T"]
    frames = _clamp(opt, lo, min(hi, rows // upsample))
    samples = (frames[0] * upsample, frames[1] * upsample, frames[2] * upsample)
    hift = {"B": (1, 1, 1), "T": frames, "TU": samples}
    ranges["hift_source"] = {**hift, "L": samples}
    ranges["hift_decoder"] = hift
    return ranges


def _vits_ranges(c: dict[str, Any], d: DeviceProfile) -> dict[str, dict[str, Range]]:
    """Piper VITS: one call holds the sentences of one text (batch), each at most VITS_MAX_IDS phoneme ids (the
    segmenter cuts longer sentences)."""
    return {"vits": {"batch_size": (1, 1, max(32, d.max_rows)), "phonemes": (1, 128, VITS_MAX_IDS)}}


_FAMILIES: dict[str, Callable[[dict[str, Any], DeviceProfile], dict[str, dict[str, Range]]]] = {
    "cosyvoice2": _cosyvoice2_ranges, "cosyvoice3": _cosyvoice3_ranges, "vits": _vits_ranges}


def _input_profile(graph: str, spec: Any, dims: dict[str, Range]) -> InputProfile | None:
    """None for a static input (no profile needed); a symbol without a rule is a BundleError."""
    if all(isinstance(d, int) for d in spec.shape):
        return None
    lows, opts, highs = [], [], []
    for dim in spec.shape:
        if isinstance(dim, int):
            lo = opt = hi = dim
        elif dim in dims:
            lo, opt, hi = dims[dim]
        else:
            raise BundleError(f"graph {graph!r} input {spec.name!r}: no TensorRT profile rule for dimension {dim!r}")
        lows.append(lo), opts.append(opt), highs.append(hi)
    return InputProfile(spec.name, tuple(lows), tuple(opts), tuple(highs))


def graph_profiles(bundle: Bundle, selection: str, device: DeviceProfile) -> dict[str, GraphProfile]:
    """One profile per graph the runtime runs on a GPU provider under `selection` (a target or a precision).

    Graphs without a rule of their family (CAM++, the speech tokenizer) run on the CPU provider and get none.
    """
    make = _FAMILIES.get(bundle.manifest.family)
    if make is None:
        raise BundleError(f"family {bundle.manifest.family!r} has no TensorRT profile rules")
    ranges = make(bundle.manifest.config, device)
    out: dict[str, GraphProfile] = {}
    for graph, component in bundle.selected(selection).items():
        dims = ranges.get(graph)
        if dims is None:
            continue
        inputs = tuple(p for p in (_input_profile(graph, spec, dims) for spec in component.inputs) if p is not None)
        out[graph] = GraphProfile(graph, component, inputs)
    return out
