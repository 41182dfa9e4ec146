"""The `cosyedge` command line. Every user error ends as one line on stderr and exit status 2.

The runtime's own commands are here (synth, synth-batch, voices, info); other layers add theirs through
entry points of the group `cosyedge.commands` (each a `register(subparsers)`), so this module imports neither
the API nor the build host.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from cosyedge.device.bundle import PRECISIONS, TARGETS
from cosyedge.device.errors import CosyedgeError, InputError
from cosyedge.device.request import SYNTH, SYNTH_BATCH, add_flags, add_in_flight, check_in_flight

COMMANDS = "cosyedge.commands"  # entry-point group: register(subparsers) of another layer's commands

log = logging.getLogger("cosyedge")


def _engine(args: argparse.Namespace):
    from cosyedge.device.engine import Engine
    return Engine.load(args.bundle, precision=args.precision, target=args.target)


def writable(path: Path) -> Path:
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"output path {path.name!r} is a directory; give a file name")
    if not parent.is_dir():
        raise InputError(f"output directory {parent.name!r} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"output path {path.name!r} is not writable")
    return path


def cmd_synth(args: argparse.Namespace) -> int:
    from cosyedge.device import request
    from cosyedge.device.audio import check_format, check_sample_rate, encode_wave
    from cosyedge.device.door import Door, Job, collect
    from cosyedge.device.options import on_rate
    from cosyedge.device.subtitles import format_of, write
    text = sys.stdin.read() if args.text == "-" else args.text
    out = writable(Path(args.output))
    subtitles = writable(Path(args.subtitles)) if args.subtitles else None
    subtitle_format = format_of(subtitles) if subtitles else None
    fmt = check_format(args.format or (out.suffix.lstrip(".") or "wav"))
    check_sample_rate(args.sample_rate)  # before the engine loads
    engine = _engine(args)
    job = request.parse(request.cli_values(args, request.SYNTH, text=text, format=fmt), request.SYNTH, engine)
    words = subtitles is not None
    with Door(engine) as door:  # the one way into the engine, as for every other door (a whole file)
        chunks = list(door.stream(Job(engine.segments(job.text, words=words), job.options, chunked=False,
                                      words=words)))
    wave = collect(chunks)
    _write(out, encode_wave(wave, engine.sample_rate, job.format, job.sample_rate))
    if subtitles is not None:
        timed = on_rate([word for chunk in chunks for word in chunk.words], job.rate(engine.sample_rate))
        _write(subtitles, write(timed, len(wave) / engine.sample_rate, subtitle_format).encode())
    print(f"{out.name}: {len(wave) / engine.sample_rate:.2f} s of audio at {job.rate(engine.sample_rate)} Hz",
          file=sys.stderr)
    return 0


def _write(path: Path, data: bytes) -> None:
    try:
        path.write_bytes(data)
    except OSError as exc:  # a file system that refuses (read-only, /proc, full): the user's to fix
        raise InputError(f"cannot write {path.name!r}: {exc.strerror or type(exc).__name__}") from None


def cmd_synth_batch(args: argparse.Namespace) -> int:
    from cosyedge.device import request
    from cosyedge.device.audio import check_sample_rate
    from cosyedge.device.jobs import DEAD_LETTER, read_lines, run_job
    lines = read_lines(Path(args.input))
    out_dir = Path(args.out_dir)
    check_sample_rate(args.sample_rate)  # before the engine loads
    if args.in_flight is not None:
        check_in_flight(args.in_flight)
    if args.ray is not None:
        from cosyedge.device.ray_jobs import check_actors, run_ray_job
        summary = run_ray_job(args.ray, lines, out_dir, request.cli_values(args, request.SYNTH_BATCH),
                              bundle=args.bundle, precision=args.precision, target=args.target,
                              actors=None if args.actors is None else check_actors(args.actors),
                              in_flight=args.in_flight, subtitles=args.subtitles, progress=not args.quiet)
    elif args.actors is not None:
        raise InputError("--actors goes with --ray")
    else:
        engine = _engine(args)
        job = request.parse(request.cli_values(args, request.SYNTH_BATCH), request.SYNTH_BATCH, engine)
        summary = run_job(engine, lines, out_dir, job, progress=not args.quiet, in_flight=args.in_flight,
                          subtitles=args.subtitles)
    print(json.dumps(summary))
    if summary["failed"]:
        print(f"{summary['failed']} line(s) failed; see {out_dir.name}/{DEAD_LETTER}", file=sys.stderr)
    return 1 if summary["failed"] else 0


def cmd_voices(args: argparse.Namespace) -> int:
    """List voices (speaker id, name); `voices add` registers a zero-shot voice, `voices remove` deletes one."""
    engine = _engine(args)
    if args.voices_command == "add":
        try:
            audio = Path(args.wav).read_bytes()
        except OSError:
            raise InputError(f"prompt audio {Path(args.wav).name!r} cannot be read") from None
        engine.add_voice(args.name, audio, args.text)
        print(f"registered voice {args.name!r}", file=sys.stderr)
    elif args.voices_command == "remove":
        engine.remove_voice(args.name)
        print(f"removed voice {args.name!r}", file=sys.stderr)
    else:
        for index, name in enumerate(engine.voices()):
            print(f"{index}\t{name}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from cosyedge.device.bundle import Bundle
    bundle = Bundle.load(args.bundle, verify=args.verify)
    data = asdict(bundle.manifest)
    data["verified"] = bool(args.verify)
    print(json.dumps(data, indent=2, ensure_ascii=False))
    return 0


    return 0


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", default=os.environ.get("COSYEDGE_BUNDLE") or None,
                        help="bundle directory (default: $COSYEDGE_BUNDLE, as for serve; else the embedded default voice)")
    parser.add_argument("--precision", default="auto", choices=("auto", *PRECISIONS),
                        help="numeric format of the graphs; auto: the bundle's target for this machine, else its "
                             "measured default")
    parser.add_argument("--target", choices=TARGETS,
                        help="a build target written by `cosyedge quantize --target` (instead of --precision)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cosyedge", description="Offline text-to-speech appliance")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="speak TEXT (or - for stdin) into an audio file")
    p.add_argument("text")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--subtitles", metavar="FILE.vtt|FILE.srt",
                   help="also write the words' times as WebVTT or SRT (by the name's suffix; families with word times)")
    add_engine_args(p)
    add_flags(p, SYNTH)  # the request declaration's fields (cosyedge.device.request); --format default: the suffix
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("synth-batch", help="speak every line of a .txt or .csv (id,text) file, resumably")
    p.add_argument("input")
    p.add_argument("--out-dir", required=True)
    add_engine_args(p)
    add_flags(p, SYNTH_BATCH)
    add_in_flight(p)
    p.add_argument("--subtitles", choices=("vtt", "srt"),
                   help="also write each line's word times as <id>.vtt or <id>.srt beside its audio (resumable with it)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--ray", metavar="local|ADDRESS",
                   help="render on a Ray cluster: local (a throwaway one on this machine) or a running cluster's "
                        "HOST:PORT; needs cosyedge[ray] on every node and the bundle at the same path "
                        "(docs/scale-out.md); --in-flight is then per actor")
    p.add_argument("--actors", type=int, metavar="N",
                   help="with --ray: engines on the cluster, each with its share of the CPUs (default: one per node)")
    p.set_defaults(func=cmd_synth_batch)

    p = sub.add_parser("voices", help="list, add or remove the voices of a bundle")
    add_engine_args(p)
    p.set_defaults(func=cmd_voices, voices_command=None)
    voices = p.add_subparsers(dest="voices_command")
    add = voices.add_parser("add", help="register a zero-shot voice from a 1-30 s recording and its transcript")
    add.add_argument("name")
    add.add_argument("--wav", required=True, help="prompt recording (wav, flac, ogg or mp3; any sample rate)")
    add.add_argument("--text", required=True, help="what the speaker says in the recording")
    add_engine_args(add)
    remove = voices.add_parser("remove", help="delete a registered voice")
    remove.add_argument("name")
    add_engine_args(remove)

    p = sub.add_parser("info", help="show a bundle's manifest")
    p.add_argument("bundle")
    p.add_argument("--verify", action="store_true", help="check every file's sha256")
    p.set_defaults(func=cmd_info)

    for entry in sorted(entry_points(group=COMMANDS), key=lambda e: e.name):
        entry.load()(sub)  # the bench, quantize (build host), serve and bench-api (API)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except CosyedgeError as exc:
        print(f"cosyedge: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cosyedge: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug, not the user's input: still one line, the detail with -v
        if args.verbose:
            raise
        print(f"cosyedge: internal error ({type(exc).__name__}); rerun with -v for the details", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
