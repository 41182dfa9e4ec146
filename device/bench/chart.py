"""The CosyVoice bench as a PNG bar chart, drawn with matplotlib (the optional `chart` extra).

Without matplotlib `write_chart` returns None and the bench still writes its JSON and text table; the CLI then
prints `CHART_HINT`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from cosyedge.device.bench.report import run_precision

CHART_HINT = "the chart needs matplotlib: pip install cosyedge[chart]"
METRICS = (("rtf", "RTF (1.0 = real time)"), ("first_chunk_s_p50", "first chunk p50 (s)"),
           ("throughput_audio_s_per_s", "throughput (audio s / s)"))


def write_chart(report: dict[str, Any], path: Path) -> Path | None:
    """Three panels (RTF, first-chunk p50, throughput), one bar per run numbered as the table's rows; colour =
    backend and precisions, hatched = stream off. None (nothing written) when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        return None
    runs = report["runs"]
    labels = [f"{r['backend']} {run_precision(r)}" for r in runs]
    palette = {label: f"C{i}" for i, label in enumerate(dict.fromkeys(labels))}
    numbers = [str(i) for i in range(1, len(runs) + 1)]
    figure = Figure(figsize=(max(6.0, 1.2 + 0.45 * len(runs)) * len(METRICS) / 2, 4.2), layout="constrained")
    axes = figure.subplots(1, len(METRICS))
    for ax, (metric, title) in zip(axes, METRICS):
        bars = ax.bar(numbers, [run[metric] or 0.0 for run in runs], color=[palette[label] for label in labels],
                      edgecolor="black", linewidth=0.5)
        for bar, run in zip(bars, runs):
            if not run["stream"]:
                bar.set_hatch("//")
        if metric == "rtf":
            ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("run (table row)")
    handles = [Patch(facecolor=color, edgecolor="black", linewidth=0.5, label=label) for label, color in palette.items()]
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(palette), 4), fontsize=8,
                  title="bars hatched: stream off", title_fontsize=8)
    path = Path(path)
    figure.savefig(path, format="png", dpi=100)
    return path
