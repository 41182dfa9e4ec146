"""Quality presets of the CosyVoice2 flow: how many Euler steps, how many of them with classifier-free guidance,
and how much token history a streamed chunk re-solves.

`official` is the release's recipe (`n_timesteps` cosine-scheduled Euler steps, CFG on every step, every chunk
re-solving the whole history): it matches the official implementation's goldens within the parity tests'
tolerances (float32 round-off of our graphs, not bit-identical). The faster presets trade accuracy for estimator work
on the same cosine schedule: fewer steps; guidance only on the first steps (the later ones run the conditional row
alone, half the rows); streaming chunks that re-solve only the prompt plus a window of recent tokens (linear, not
quadratic, in the utterance length); a first streamed chunk that does not wait for the tokens which would bring
prompt + first hop to a chunk boundary (`first_hop_pad` off: 0 to hops[0] - 1 fewer decode steps before first audio,
depending on the voice's prompt length). Each preset's cost and distance from `official` is measured when the bundle
is built (quantize/cosyvoice2/preset_report.py) and stored in `manifest.quality["presets"]`; a bundle lists in
`manifest.config["presets"]` only the presets that passed their gate. Bundles written before presets existed get
the built-in definitions below, marked unmeasured in `describe()`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from cosyedge.device.errors import BundleError

OFFICIAL = "official"


@dataclass(frozen=True)
class Preset:
    """One flow recipe. `cfg_steps` >= `steps` means guidance on every step; `stream_window` None: whole history;
    `first_hop_pad` the official first hop (padded to a chunk boundary, streaming.py), off: hops[0] tokens."""
    name: str
    steps: int
    cfg_steps: int
    stream_window: int | None = None
    first_hop_pad: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1 or self.cfg_steps < 0 or (self.stream_window is not None and self.stream_window < 0):
            raise BundleError(f"flow preset {self.name!r}: steps >= 1, cfg_steps >= 0, stream_window >= 0 or null")

    def estimator_rows(self, rows: int = 1) -> int:
        """Estimator rows over the whole solve for `rows` utterances: 2 per guided step, 1 per unguided one."""
        guided = min(self.cfg_steps, self.steps)
        return rows * (2 * guided + (self.steps - guided))

    def window_start(self, offset: int, align: int) -> int:
        """First token a streamed chunk re-solves when `offset` tokens are voiced already: `stream_window` tokens of
        context before the offset, rounded down to a multiple of `align` (the flow's chunk size), 0 = all history."""
        if self.stream_window is None:
            return 0
        return max(0, (offset - self.stream_window) // align * align)

    def to_config(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "name"}

    @classmethod
    def from_config(cls, name: str, entry: dict[str, Any]) -> "Preset":
        try:
            window, pad = entry.get("stream_window"), entry.get("first_hop_pad", True)
            if not isinstance(pad, bool):
                raise TypeError(pad)
            return cls(name, int(entry["steps"]), int(entry["cfg_steps"]), None if window is None else int(window), pad)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise BundleError(f"manifest config: flow preset {name!r} is malformed; re-create the bundle") from None


def builtin_presets(n_timesteps: int) -> dict[str, Preset]:
    """`official` and the faster candidates, in order of decreasing cost (the build measures and gates them).

    Windows are multiples of the first streaming hop (25 tokens), so the windowed chunk keeps the flow's chunk
    mask alignment (quantize/cosyvoice2/flow_export.py: static chunks of 25 tokens / 50 frames)."""
    return {OFFICIAL: Preset(OFFICIAL, n_timesteps, n_timesteps),
            "balanced": Preset("balanced", 5, 5, 100),   # half the estimator rows, guidance kept
            "fast": Preset("fast", 3, 2, 50),            # a quarter of the rows
            "fastest": Preset("fastest", 2, 1, 50, first_hop_pad=False)}  # 15 % of the rows, first audio sooner


def bundle_presets(config: dict[str, Any]) -> tuple[dict[str, Preset], str, bool]:
    """(presets by name, default name, measured) from `manifest.config`; older bundles: the built-ins, unmeasured."""
    n_timesteps = int(config["n_timesteps"])
    if "presets" not in config:
        return builtin_presets(n_timesteps), OFFICIAL, False
    presets = {name: Preset.from_config(name, entry) for name, entry in config["presets"].items()}
    default = str(config.get("default_preset", OFFICIAL))
    if OFFICIAL not in presets or default not in presets:
        raise BundleError("manifest config: the flow presets must include 'official' and the default; "
                          "re-create the bundle")
    return presets, default, True
