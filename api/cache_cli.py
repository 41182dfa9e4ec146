"""`cosyedge cache warm|stats|clear`: the service's phrase cache from the command line.

`warm` renders a list of phrases into the cache the service reads (same state directory, bundle and keys), one
line at a time with `synth-batch`'s progress bar and dead-letter file; a line already cached is skipped, so a
killed run resumes where it stopped. `clear` deletes the cache's entries and nothing else.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from cosyedge.device.engine import TARGETS
from cosyedge.device.errors import InputError
from cosyedge.device.request import CACHE_WARM, add_flags, add_in_flight, check_in_flight

if TYPE_CHECKING:
    from cosyedge.api.config import ServiceConfig
    from cosyedge.device import Line

DEAD_LETTER = "warm_dead_letter.jsonl"  # in the cache folder; `clear` leaves it


def _config(args: argparse.Namespace) -> "ServiceConfig":
    from cosyedge.api.config import load_config
    return load_config(args.config, state_dir=args.state_dir, bundle=getattr(args, "bundle", None),
                       precision=getattr(args, "precision", None), target=getattr(args, "target", None))


def warm(args: argparse.Namespace) -> int:
    from cosyedge.api.cache import FOLDER, Entry, content_type, open_cache
    from cosyedge.api.service import load_engine, voice_aliases
    from cosyedge.device import Door, Job, collect, read_lines, request, run_lines
    from cosyedge.device.audio import encode_wave
    from cosyedge.device.paths import make_dir
    config = _config(args)
    if config.cache_max_mb <= 0:
        raise InputError("the phrase cache is off (cache_max_mb = 0); nothing to warm")
    lines = read_lines(Path(args.phrases))
    if args.in_flight is not None:
        check_in_flight(args.in_flight)  # before the engine loads
    cache = open_cache(config.state_dir, config.cache_max_mb)
    engine = load_engine(config)
    job = request.parse(request.cli_values(args, request.CACHE_WARM), request.CACHE_WARM, engine,
                        voice_aliases(config, engine))  # what a request with these fields gets
    options, fmt = job.options, job.format
    if not engine.reproducible(options):
        raise InputError("these options do not give the same audio twice, so the service would never serve them "
                         "from the cache; add --seed N (or --deterministic, and for CosyVoice --sampling greedy)")
    rate = engine.sample_rate

    def key(line: "Line") -> str:
        return cache.key(engine, engine.segments(line.text), options, fmt, job.sample_rate) or ""

    def render(line: "Line") -> float:
        work = Job(engine.segments(line.text), options, chunked=False)  # what the service's door runs for a file
        wave = collect(door.stream(work))
        audio = encode_wave(wave, rate, fmt, job.sample_rate)
        seconds = round(len(wave) / rate, 3)
        cache.put(key(line), Entry(audio, content_type(fmt, job.rate(rate)), seconds))
        return seconds

    make_dir(cache.root, "phrase cache folder")
    with Door(engine) as door:
        summary = run_lines(lines, render, lambda line: cache.has(key(line)), cache.root / DEAD_LETTER,
                            progress=not args.quiet,
                            in_flight=engine.limits.batch_max if args.in_flight is None else args.in_flight)
    print(json.dumps({**summary, **cache.stats()}))
    if summary["failed"]:
        print(f"{summary['failed']} line(s) failed; see {FOLDER}/{DEAD_LETTER} in the state directory", file=sys.stderr)
    return 1 if summary["failed"] else 0


def stats(args: argparse.Namespace) -> int:
    from cosyedge.api.cache import open_cache
    config = _config(args)
    print(json.dumps(open_cache(config.state_dir, config.cache_max_mb).stats()))
    return 0


def clear(args: argparse.Namespace) -> int:
    from cosyedge.api.cache import open_cache
    config = _config(args)
    removed = open_cache(config.state_dir, config.cache_max_mb).clear()
    print(f"removed {removed} cached phrase(s)", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `cosyedge cache warm|stats|clear`."""
    p = sub.add_parser("cache", help="the service's phrase cache: pre-render phrases, show its size, clear it")
    actions = p.add_subparsers(dest="cache_command", required=True)
    for name, func, text in (("warm", warm, "render every line of a .txt (or .csv id,text) file into the cache"),
                             ("stats", stats, "entries and bytes in the cache"),
                             ("clear", clear, "delete every cached phrase (nothing else)")):
        a = actions.add_parser(name, help=text)
        a.set_defaults(func=func)
        a.add_argument("--config", help="the service's TOML file (default: $COSYEDGE_CONFIG, else the defaults)")
        a.add_argument("--state-dir", help="the service's state directory (default: from the configuration)")
    warm_parser = actions.choices["warm"]
    warm_parser.add_argument("phrases")
    warm_parser.add_argument("--bundle", help="bundle directory (default: the service's)")
    warm_parser.add_argument("--precision", help="fp32, fp16, int8, int4 or auto (default: the service's)")
    warm_parser.add_argument("--target", choices=TARGETS)
    add_flags(warm_parser, CACHE_WARM)  # the request declaration's fields, as a request would send them
    add_in_flight(warm_parser)
    warm_parser.add_argument("--quiet", action="store_true", help="no progress bar")
