"""`cosyedge quantize`: the build host's command, added to the `cosyedge` CLI through the entry point
`cosyedge.commands: quantize` (the runtime's CLI never imports this package). Torch and the model-family
exporters are imported inside the command, so `cosyedge --help` stays fast and works without the extra."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from cosyedge.device.bundle import TARGETS, Bundle
from cosyedge.device.errors import InputError


def _similarity():
    """Resemblyzer speaker similarity for the quality report (available=False, with a reason, without torch)."""
    from cosyedge.quantize.quality import SpeakerSimilarity
    return SpeakerSimilarity()


def _random_release(args: argparse.Namespace) -> int:
    from cosyedge.quantize.cosyvoice2 import random_init as v2
    from cosyedge.quantize.cosyvoice3 import random_init as v3
    if not args.template:
        raise InputError("--random-init needs --template RELEASE_DIR (tokenizer and front-end models are copied from it)")
    family = v3 if args.random_init in v3.PRESETS else v2
    if family is v2 and args.random_init not in v2.PRESETS:
        raise InputError(f"unknown --random-init preset {args.random_init!r}; known: "
                         f"{', '.join([*v2.PRESETS, *v3.PRESETS])}")
    path = family.write_random_release(args.random_init, Path(args.template), Path(args.out))
    print(json.dumps({"release": str(path), "preset": args.random_init}))
    return 0


def _build(args: argparse.Namespace, targets: list[str]) -> Path:
    """The bundle the arguments ask for: a CosyVoice2 or Fun-CosyVoice3 release, a Piper voice, or the embedded
    default voice."""
    from cosyedge.device.vits.convert import build_piper_bundle
    from cosyedge.device.vits.default_voice import DEFAULT_NAME, build_default_bundle, default_bundle
    if args.model_dir:
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise InputError(f"unknown --target {unknown[0]!r}; choose from {', '.join(TARGETS)}")
        if (Path(args.model_dir) / "cosyvoice3.yaml").is_file():  # routed by the release's yaml
            from cosyedge.quantize.cosyvoice3.bundle import write_bundle as write_cosyvoice3
            return write_cosyvoice3(Path(args.model_dir), Path(args.out), targets=list(dict.fromkeys(targets)),
                                    allow_fallback=args.allow_fallback)
        from cosyedge.quantize.cosyvoice2.bundle import write_bundle
        return write_bundle(Path(args.model_dir), Path(args.out), targets=list(dict.fromkeys(targets)),
                            allow_fallback=args.allow_fallback)
    if args.piper_model:
        if not args.out:
            raise InputError("--out is required with --piper-model")
        model = Path(args.piper_model)
        return build_piper_bundle(model, Path(args.piper_config or f"{model}.json"), Path(args.out),
                                  similarity=_similarity())
    if args.out:
        return build_default_bundle(Path(args.out), _similarity())
    if args.force:  # the writer swaps the old bundle out atomically; it never deletes foreign files
        from cosyedge.device.paths import bundles_dir
        return build_default_bundle(bundles_dir() / DEFAULT_NAME, _similarity())
    return default_bundle()


def cmd_quantize(args: argparse.Namespace) -> int:
    if (args.model_dir or args.random_init) and not args.out:
        raise InputError("--out is required with --model-dir and --random-init")
    if args.random_init:
        return _random_release(args)
    targets = [t for item in args.target or () for t in item.split(",") if t]
    if (targets or args.allow_fallback) and not args.model_dir:
        raise InputError("--target and --allow-fallback apply to --model-dir (CosyVoice releases) only")
    path = _build(args, targets)
    manifest = Bundle.load(path, verify=False).manifest
    print(json.dumps({"bundle": str(path), "family": manifest.family, "precisions": manifest.precisions,
                      "default_precision": manifest.default_precision, "quality": manifest.quality}, indent=2))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Entry point `cosyedge.commands: quantize`."""
    p = sub.add_parser("quantize", help="build a bundle (no arguments: the embedded default voice)")
    p.add_argument("--model-dir", help="an official CosyVoice2 (cosyvoice2.yaml) or Fun-CosyVoice3 (cosyvoice3.yaml) release "
                        "directory -> cosyvoice2 / cosyvoice3 bundle")
    p.add_argument("--random-init", metavar="PRESET",
                   help="write a random-weight release of real size (cosyvoice2-0.5b, cosyvoice3-0.5b)")
    p.add_argument("--template", help="with --random-init: release to copy tokenizer, front-end models, spk2info from")
    p.add_argument("--piper-model", help="a Piper voice .onnx")
    p.add_argument("--piper-config", help="its .onnx.json (default: next to the model)")
    p.add_argument("--out", help="bundle directory to write")
    p.add_argument("--target", action="append", metavar="TARGET",
                   help="with --model-dir: also build cpu, cpu-int4 (cpu with a 4-bit LLM), gpu-fp16 and/or trt-int8 graphs "
                        "(repeatable or comma list); each quantized stage must pass its quality gate against fp32")
    p.add_argument("--allow-fallback", action="store_true",
                   help="a stage that misses its gate keeps the next higher precision instead of failing the build")
    p.add_argument("--force", action="store_true", help="rebuild the default voice's bundle")
    p.set_defaults(func=cmd_quantize)
