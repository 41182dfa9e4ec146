"""GPU check (tools/gpu-check.sh): each target of a bundle on the CPU, CUDA and TensorRT providers, compared with
the CPU provider, then a small bench. Providers that are not usable here are skipped with the reason.

Tolerances (greedy decoding, NSF noise off, so runs are deterministic): speech tokens equal; waveform SNR against
the CPU run >= 30 dB for fp32 graphs and >= 20 dB for fp16 / int8 graphs (TensorRT picks its own kernels and
accumulation order; the flow's 10 Euler steps and HiFT's phase amplify rounding); same length exactly.
Usage: python tools/gpu_check.py [--bundle B] [--texts N] [--json out.json]; no --bundle: builds the tiny bundle
from ../shared/golden/cosyvoice2-tiny with every target (needs the build-host extra, torch).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TEXTS = ("你好，世界！", "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。")
SNR_DB = {"fp32": 30.0, "fp16": 20.0, "int8": 20.0}
PROVIDERS = (("cpu", "CPUExecutionProvider"), ("cuda", "CUDAExecutionProvider"), ("tensorrt", "TensorrtExecutionProvider"))


def _snr(ref: np.ndarray, out: np.ndarray) -> float:
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    return float(10 * np.log10((ref ** 2).sum() / max(((out - ref) ** 2).sum(), 1e-30)))


def _tiny_bundle(work: Path) -> Path:
    from cosyedge.quantize.cosyvoice2.bundle import write_bundle
    release = Path(__file__).resolve().parents[1].parent / "shared" / "golden" / "cosyvoice2-tiny"
    return write_bundle(release, work / "tiny", targets=("cpu", "gpu-fp16", "trt-int8"), allow_fallback=True)


def _run(bundle: Path, selection: str, provider: str, voice: str | None, texts) -> dict:
    from cosyedge.device.engine import Engine
    from cosyedge.device.options import SynthesisOptions
    from cosyedge.device.sessions import SessionConfig
    trt = SessionConfig.from_env().trt if provider == "tensorrt" else None  # profiles, caches, device limits
    config = SessionConfig(providers=tuple(dict.fromkeys((provider, "cpu"))), trt=trt)  # cpu: unsupported nodes
    began = time.perf_counter()
    engine = Engine.load(bundle, precision=selection, sessions=config, warmup=False)
    load = time.perf_counter() - began
    voice = voice or engine.voices()[0]
    options = {"voice": voice, "sampling": "greedy", "deterministic": True}
    tokens, waves, seconds = [], [], []
    for text in texts:
        tokens.append([engine.pipeline.speech_tokens(s, SynthesisOptions(**options)) for s in engine.segments(text)])
        runs = []
        for _ in range(3):
            began = time.perf_counter()
            wave = engine.synthesize_waveform(text, **options)
            runs.append(time.perf_counter() - began)
        waves.append(wave)
        seconds.append(statistics.median(runs))
    audio = sum(len(w) for w in waves) / engine.sample_rate
    return {"tokens": tokens, "waves": waves, "load_s": load, "rtf": sum(seconds) / max(audio, 1e-9),
            "precision": engine.pipeline.describe()["precision"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle")
    parser.add_argument("--texts", type=int, default=len(TEXTS))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from cosyedge.device.bundle import Bundle
    from cosyedge.device.trt.providers import probe_providers
    usable = {s.name: s for s in probe_providers()}
    with tempfile.TemporaryDirectory() as work:
        bundle_path = Path(args.bundle) if args.bundle else _tiny_bundle(Path(work))
        bundle = Bundle.load(bundle_path, verify=False)
        selections = list(bundle.targets) or [bundle.manifest.default_precision]
        texts = TEXTS[:args.texts]
        report, failed = [], False
        for short, name in PROVIDERS:
            if not usable[name].usable:
                print(f"SKIP {name}: {usable[name].reason} (no GPU check on this provider here)")
        for selection in selections:
            reference = None
            for short, name in PROVIDERS:
                if not usable[name].usable:
                    continue
                result = _run(bundle_path, selection, short, None, texts)
                row = {"selection": selection, "provider": short, "rtf": round(result["rtf"], 4),
                       "load_s": round(result["load_s"], 2)}
                if reference is None:
                    reference = result
                    row |= {"tokens_equal": True, "min_snr_db": None, "ok": True}
                else:
                    worst = min(SNR_DB[p] for p in result["precision"].values())
                    same = result["tokens"] == reference["tokens"]
                    lengths = all(a.shape == b.shape for a, b in zip(result["waves"], reference["waves"]))
                    snr = min(_snr(a, b) for a, b in zip(reference["waves"], result["waves"])) if lengths else float("-inf")
                    row |= {"tokens_equal": same, "min_snr_db": round(snr, 1), "ok": same and lengths and snr >= worst}
                    failed |= not row["ok"]
                report.append(row)
                print(f"{selection:10} {short:9} tokens {'equal' if row['tokens_equal'] else 'DIFFER'}  "
                      f"snr {row['min_snr_db'] if row['min_snr_db'] is not None else 'ref':>6}  rtf {row['rtf']:.4f}  "
                      f"load {row['load_s']:.2f} s  {'ok' if row['ok'] else 'FAIL'}")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
