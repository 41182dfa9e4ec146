"""Bench reports as files and text: the JSON file and the tables printed to the terminal."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(report: dict[str, Any], path: Path) -> Path:
    """The report, indented, UTF-8 (the CosyVoice texts are Chinese and English)."""
    path = Path(path)
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def engine_table(report: dict[str, Any]) -> str:
    """Piper/VITS bench: one row per sentence, one RTF column per runner, the total RTF last."""
    names = list(report["results"])
    width = max(18, *(len(n) + 2 for n in names))
    lines = ["sentence".ljust(48) + "".join(n.rjust(width) for n in names)]
    for index, row in enumerate(report["results"][names[0]]["sentences"]):
        lines.append(row["text"][:46].ljust(48)
                     + "".join(f"{report['results'][n]['sentences'][index]['rtf']:{width}.4f}" for n in names))
    lines.append("TOTAL RTF".ljust(48) + "".join(f"{report['results'][n]['rtf']:{width}.4f}" for n in names))
    if "word_times" in report:
        words = report["word_times"]
        lines.append(f"word times: {words['runner']} RTF {words['rtf_cost_pct']:+.2f} %; word mapping "
                     f"{words['mapping_ms_per_sentence']:.3f} ms per sentence = {words['mapping_cost_pct']:.2f} % "
                     "of synthesis")
    return "\n".join(lines)


def run_precision(run: dict[str, Any]) -> str:
    """The precisions of a run's stages in stage order, e.g. `int8+fp32`."""
    return "+".join(dict.fromkeys(run["precision"].values()))


def rtf_ratios(runs: list[dict[str, Any]], other: str) -> list[dict[str, Any]]:
    """Every device run at concurrency 1 against the `other` backend's run of the same streaming mode: our RTF /
    theirs (`rtf_ratio`) and its inverse (`speedup`: how many times faster the device is)."""
    theirs = {r["stream"]: r for r in runs if r["backend"] == other and r["rtf"]}
    return [{"bundle": run["bundle"], "precision": run_precision(run), "preset": run.get("preset"),
             "stream": run["stream"], "rtf_ratio": round(run["rtf"] / ref["rtf"], 4),
             "speedup": round(ref["rtf"] / run["rtf"], 3) if run["rtf"] else None}
            for run in runs if run["backend"] == "device" and run["concurrency"] == 1
            and (ref := theirs.get(run["stream"])) is not None]


def cosyvoice_table(report: dict[str, Any]) -> str:
    """CosyVoice bench: one numbered row per run (the chart numbers its bars the same way), then the device /
    reference and device / peer (vox-tts) RTF ratios per streaming mode when they ran."""
    def num(value: Any, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    header = ("#", "backend", "precision", "preset", "conc", "stream", "audio_s", "wall_s", "rtf", "fc_p50", "fc_p95",
              "stall_p95", "ms/tok", "front_s", "prefill_s", "decode_s", "flow_s", "hift_s", "align_s", "align_%",
              "rss_mb", "audio_s/s")
    rows = []
    several = len({r["bundle"] for r in report["runs"] if r["backend"] == "device"}) > 1   # --compare: name them

    def backend(run: dict[str, Any]) -> str:
        return f"{run['backend']}:{run['bundle']}" if several and run["backend"] == "device" else run["backend"]

    for index, run in enumerate(report["runs"], 1):
        s = run["stage_s"]
        rows.append((str(index), backend(run), run_precision(run), run.get("preset") or "-", str(run["concurrency"]),
                     "on" if run["stream"] else "off", num(run["audio_s"], 2), num(run["wall_s"], 2), num(run["rtf"]),
                     num(run["first_chunk_s_p50"]), num(run["first_chunk_s_p95"]),
                     num(run.get("stall_s_p95")), num(run["llm_ms_per_token"], 1),
                     num(s["frontend"]), num(s["llm_prefill"]), num(s["llm_decode"]), num(s["flow"]), num(s["hift"]),
                     num(s.get("align") or None), num(run.get("align_cost_pct"), 2),
                     num(run["peak_rss_mb"], 0), num(run["throughput_audio_s_per_s"])))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)] if rows else [len(h) for h in header]
    lines = ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in (header, *rows)]
    for other in ("reference", "vox-tts"):
        for ratio in rtf_ratios(report["runs"], other):
            label = " ".join(filter(None, (ratio["precision"], ratio["preset"])))
            lines.append(f"{backend({'backend': 'device', 'bundle': ratio['bundle']})} {label} / {other} RTF, stream "
                         f"{'on' if ratio['stream'] else 'off'}: {ratio['rtf_ratio']:.3f}"
                         + (f" = 1/{ratio['speedup']:.2f}" if ratio["speedup"] else ""))
    return "\n".join(lines)
