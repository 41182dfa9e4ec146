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


def cosyvoice_table(report: dict[str, Any]) -> str:
    """CosyVoice bench: one numbered row per run (the chart numbers its bars the same way), then the device /
    reference RTF ratio per streaming mode when the reference ran."""
    def num(value: Any, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    header = ("#", "backend", "precision", "preset", "conc", "stream", "audio_s", "wall_s", "rtf", "fc_p50", "fc_p95", "ms/tok",
              "front_s", "prefill_s", "decode_s", "flow_s", "hift_s", "align_s", "align_%", "rss_mb", "audio_s/s")
    rows = []
    several = len({r["bundle"] for r in report["runs"] if r["backend"] == "device"}) > 1   # --compare: name them

    def backend(run: dict[str, Any]) -> str:
        return f"{run['backend']}:{run['bundle']}" if several and run["backend"] == "device" else run["backend"]

    for index, run in enumerate(report["runs"], 1):
        s = run["stage_s"]
        rows.append((str(index), backend(run), run_precision(run), run.get("preset") or "-", str(run["concurrency"]),
                     "on" if run["stream"] else "off", num(run["audio_s"], 2), num(run["wall_s"], 2), num(run["rtf"]),
                     num(run["first_chunk_s_p50"]), num(run["first_chunk_s_p95"]), num(run["llm_ms_per_token"], 1),
                     num(s["frontend"]), num(s["llm_prefill"]), num(s["llm_decode"]), num(s["flow"]), num(s["hift"]),
                     num(s.get("align") or None), num(run.get("align_cost_pct"), 2),
                     num(run["peak_rss_mb"], 0), num(run["throughput_audio_s_per_s"])))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)] if rows else [len(h) for h in header]
    lines = ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in (header, *rows)]
    references = {r["stream"]: r for r in report["runs"] if r["backend"] == "reference"}
    for run in report["runs"]:
        ref = references.get(run["stream"])
        if run["backend"] == "device" and run["concurrency"] == 1 and ref and ref["rtf"]:
            label = " ".join(filter(None, (run_precision(run), run.get("preset"))))
            lines.append(f"{backend(run)} {label} / reference RTF, stream {'on' if run['stream'] else 'off'}: "
                         f"{run['rtf'] / ref['rtf']:.3f}")
    return "\n".join(lines)
