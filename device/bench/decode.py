"""Aggregate LLM decode throughput of the `DecodeScheduler` at several concurrencies (issue 6: >= 4x at 8 vs 1).

`python -m cosyedge.device.bench.decode BUNDLE [--rows 1 4 8] [--tokens 40] [--providers cpu] [--threads 0]`

Only the LLM graph is loaded (one `SpeechLM`, one scheduler), so the full-size bundle fits beside other work.
Every request has a zero-shot-sized prompt (a bundle voice's prompt text and speech tokens plus a 20-token text)
and its length pinned (random-weight releases never stop sensibly); N requests are submitted at once from N
threads and the wall time until the last token is taken. Tokens/s counts every generated token (the first comes
from the prefill), so the figure includes prefill, cache rebuilds and sampling; `decode_tokens_per_s` counts
the tokens of decode steps over the time spent in them (graph call + sampling) only.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.llm import DecodeConfig, SpeechLM
from cosyedge.device.cosyvoice2.scheduler import DecodeScheduler
from cosyedge.device.cosyvoice2.voices import Voice
from cosyedge.device.sessions import SessionConfig


def load(bundle_path: Path, sessions: SessionConfig) -> tuple[SpeechLM, Voice]:
    bundle = Bundle.load(bundle_path, precision="fp32")
    cfg = bundle.manifest.config
    llm = sessions.create(bundle.path(bundle.component("llm", "fp32").file))
    lm = SpeechLM(llm, bundle.asset("embed_tokens"), bundle.asset("speech_embedding"),
                  bundle.asset("llm_embedding"), DecodeConfig.from_config(cfg))
    name = bundle.manifest.voices[0]
    return lm, Voice.load(name, bundle.asset(f"voice:{name}"))


def run(scheduler: DecodeScheduler, prompts: list[np.ndarray], tokens: int) -> float:
    """Seconds until every prompt has its `tokens` tokens, all submitted at once from their own threads."""
    start = threading.Barrier(len(prompts) + 1)
    counts: list[int] = [0] * len(prompts)

    def worker(index: int) -> None:
        start.wait()
        rng = np.random.default_rng(index)
        counts[index] = sum(1 for _ in scheduler.stream(prompts[index], 20, False, rng, pin=tokens))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    assert counts == [tokens] * len(prompts), counts
    return elapsed


def bench(lm: SpeechLM, prompts: list[np.ndarray], rows_list: list[int], tokens: int, repeat: int) -> dict:
    """One line per concurrency (printed as it is measured) and the speed-ups against the first."""
    scheduler = DecodeScheduler(lm, max_rows=max(rows_list))
    run(scheduler, prompts[:1], 4)  # warm-up: lazy ORT initialisation
    results = {}
    for rows in rows_list:
        before = scheduler.stats()
        best = min(run(scheduler, prompts[:rows], tokens) for _ in range(repeat))
        after = scheduler.stats()
        steps = after["decode_steps"] - before["decode_steps"]
        row_steps = sum(k * (n - before["rows_per_step"].get(k, 0)) for k, n in after["rows_per_step"].items())
        seconds = {k: after["seconds"][k] - before["seconds"][k] for k in after["seconds"]}
        results[rows] = {"seconds": round(best, 3), "tokens_per_s": round(rows * tokens / best, 2),
                         "decode_tokens_per_s": round(row_steps / seconds["decode"], 2),
                         "mean_rows": round(row_steps / steps, 2) if steps else 0.0,
                         "split_s": {k: round(v / repeat, 3) for k, v in seconds.items()}}
        print(json.dumps({"rows": rows, **results[rows]}), flush=True)
    first = results[rows_list[0]]
    summary = {"prompt_len": int(prompts[0].shape[1]), "tokens": tokens, "provider": lm.provider,
               "speedup": {r: round(v["tokens_per_s"] / first["tokens_per_s"], 2) for r, v in results.items()},
               "decode_speedup": {r: round(v["decode_tokens_per_s"] / first["decode_tokens_per_s"], 2)
                                  for r, v in results.items()}}
    print(json.dumps(summary), flush=True)
    return {"rows": results, **summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=2, help="runs per concurrency (the best is reported)")
    parser.add_argument("--providers", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    sessions = SessionConfig(providers=tuple(args.providers.split(",")), intra_op_threads=args.threads)
    lm, voice = load(args.bundle, sessions)
    inputs = voice.inputs(None, (), 80)
    text_rng = np.random.default_rng(0)
    prompts = [lm.lm_input(text_rng.integers(1000, 20000, 20), inputs.prompt_text, inputs.prompt_speech)
               for _ in range(max(args.rows))]
    bench(lm, prompts, args.rows, args.tokens, args.repeat)


if __name__ == "__main__":
    main()
