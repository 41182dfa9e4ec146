"""`build-engines`, `memory-plan` and `providers`: added to the `cosyedge` parser by `register(subparsers)`
(entry point group `cosyedge.commands`). Every user error is one line and exit status 2."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cosyedge.device.errors import CosyedgeError, InputError, ProviderError

_PROFILE_HELP = "device profile (orin-nano-8gb, orin-nx-16gb, agx-orin-64gb, desktop; env COSYEDGE_DEVICE_PROFILE)"


def _device(args: argparse.Namespace):
    from cosyedge.device.trt.device_profiles import device_profile, profile_from_env
    base = device_profile(args.device_profile) if args.device_profile else profile_from_env()
    return device_profile(base.name, max_frames=args.max_frames or base.max_frames, max_rows=args.max_rows or base.max_rows,
                          flow_rows=base.flow_rows, workspace_mb=base.workspace_mb)


def _selection(bundle, requested: str | None) -> str:
    """What `serve` loads under TensorRT: the trt-int8 target when the bundle has it, else its default precision."""
    if requested and requested != "auto":
        return requested
    return "trt-int8" if "trt-int8" in bundle.targets else bundle.manifest.default_precision


def _gpu(args: argparse.Namespace, dry_run: bool):
    """The real GPU; for a dry run on a machine without one, the identity given on the command line (or unknown)."""
    import onnxruntime as ort

    from cosyedge.device.trt.engines import GpuIdentity, detect_gpu
    given = (args.gpu_name, args.compute_capability, args.tensorrt_version)
    if dry_run and any(given):
        return GpuIdentity(args.gpu_name or "unknown-gpu", args.compute_capability or "0.0",
                           args.tensorrt_version or "unknown", ort.__version__)
    try:
        return detect_gpu()
    except ProviderError:
        if not dry_run:
            raise
        return GpuIdentity("unknown-gpu", "0.0", "unknown", ort.__version__)


def plan_engines(args: argparse.Namespace) -> dict[str, Any]:
    """Everything `build-engines` would do, as JSON-ready data (the dry run prints it)."""
    from cosyedge.device.bundle import Bundle
    from cosyedge.device.trt.engines import cache_root, provider_options, trt_home, trtexec_command
    from cosyedge.device.trt.profiles import graph_profiles
    bundle = Bundle.load(args.bundle, verify=False)
    device = _device(args)
    selection = _selection(bundle, args.target)
    gpu = _gpu(args, args.dry_run)
    root = cache_root(Path(args.cache_dir) if args.cache_dir else trt_home(), gpu)
    profiles = graph_profiles(bundle, selection, device)
    graphs = {}
    for name, profile in profiles.items():
        graphs[name] = {"component": profile.component.name, "precision": profile.component.precision,
                        "file": profile.component.file, "provider": "TensorrtExecutionProvider",
                        "provider_options": provider_options(profile, root, device),
                        "profile": {i.name: {"min": list(i.min), "opt": list(i.opt), "max": list(i.max)}
                                    for i in profile.inputs}}
        if args.trtexec:
            graphs[name]["trtexec"] = trtexec_command(bundle, profile, root, device)
    cpu = sorted(set(bundle.selected(selection)) - set(graphs))
    return {"bundle": bundle.root.name, "family": bundle.manifest.family, "selection": selection,
            "device_profile": asdict(device), "gpu": asdict(gpu), "cache_root": str(root), "graphs": graphs,
            "cpu_graphs": cpu, "_profiles": profiles, "_bundle": bundle, "_device": device, "_root": root}


def _public(plan: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in plan.items() if not k.startswith("_")}


def cmd_build_engines(args: argparse.Namespace) -> int:
    if args.service:
        return _service(args)
    if not args.bundle:
        raise InputError("build-engines needs --bundle (or --service inside the systemd unit)")
    plan = plan_engines(args)
    if args.dry_run:
        if args.json:
            print(json.dumps(_public(plan), indent=2))
        else:
            for name, graph in plan["graphs"].items():
                print(graph["trtexec"] if args.trtexec else f"{name}: {json.dumps(graph['provider_options'])}")
        return 0
    if args.trtexec:
        for graph in plan["graphs"].values():
            print(graph["trtexec"])
        return 0
    from cosyedge.device.trt.engines import build_all
    print(f"building {len(plan['graphs'])} engine(s) for {plan['bundle']} ({plan['selection']}) on "
          f"{plan['gpu']['gpu_name']}, device profile {plan['device_profile']['name']}; cache {plan['cache_root']}",
          file=sys.stderr)
    results = build_all(plan["_bundle"], plan["_profiles"], plan["_root"], plan["_device"],
                        lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps({**_public(plan), "results": results}, indent=2))
    return 0


def _service(args: argparse.Namespace) -> int:
    """ExecStartPre of the unit: build what `serve` will load, from the service's environment; nothing to do
    (exit 0, one line) when no bundle is configured or TensorRT is not among the usable providers."""
    providers = [p.strip() for p in os.environ.get("COSYEDGE_PROVIDERS", "tensorrt,cuda,cpu").split(",")]
    bundle = args.bundle or os.environ.get("COSYEDGE_BUNDLE", "").strip()
    if "tensorrt" not in providers or not bundle:
        print("build-engines: nothing to build (no bundle configured or tensorrt not in COSYEDGE_PROVIDERS)",
              file=sys.stderr)
        return 0
    try:
        _gpu(args, dry_run=False)
    except ProviderError as exc:
        print(f"build-engines: skipped, serve falls back to the next provider: {exc}", file=sys.stderr)
        return 0
    args.bundle = bundle
    args.target = args.target or os.environ.get("COSYEDGE_TARGET") or None
    args.service, args.dry_run = False, False
    return cmd_build_engines(args)


def cmd_memory_plan(args: argparse.Namespace) -> int:
    from cosyedge.device.trt.device_profiles import PROFILES
    from cosyedge.device.trt.memory import FULL_SIZE, ModelSizes, format_plan, memory_plan
    if args.bundle:
        from cosyedge.device.bundle import Bundle
        bundle = Bundle.load(args.bundle, verify=False)
        sizes = ModelSizes.from_bundle(bundle, _selection(bundle, args.target))
    else:
        sizes = FULL_SIZE
    devices = [_device(args)] if args.device_profile else list(PROFILES.values())
    if args.json:
        print(json.dumps({d.name: memory_plan(sizes, d) for d in devices}, indent=2))
    else:
        print("\n\n".join(format_plan(sizes, d) for d in devices))
    return 0


def cmd_providers(args: argparse.Namespace) -> int:
    from cosyedge.device.trt.providers import probe_providers
    statuses = probe_providers()
    if args.json:
        print(json.dumps([asdict(s) for s in statuses], indent=2))
    else:
        for s in statuses:
            print(f"{s.name:28} {'usable' if s.usable else 'unusable'}{': ' + s.reason if s.reason else ''}")
    return 0


def _limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-profile", help=_PROFILE_HELP)
    p.add_argument("--max-frames", type=int, help="override the profile's flow frame limit (env COSYEDGE_MAX_FRAMES)")
    p.add_argument("--max-rows", type=int, help="override the profile's batch rows (env COSYEDGE_MAX_ROWS)")
    p.add_argument("--target", help="target or precision to plan for (default: trt-int8 if the bundle has it)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("build-engines", help="build the TensorRT engines a bundle needs (on the device)")
    p.add_argument("--bundle", help="bundle directory")
    _limits(p)
    p.add_argument("--dry-run", action="store_true", help="print the provider options per graph; needs no GPU")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--trtexec", action="store_true", help="print equivalent trtexec command lines (strongly typed)")
    p.add_argument("--cache-dir", help="engine cache home (default: COSYEDGE_TRT_CACHE or <state dir>/trt)")
    p.add_argument("--gpu-name", help="dry run for another device: its GPU name")
    p.add_argument("--compute-capability", help="dry run for another device: e.g. 8.7")
    p.add_argument("--tensorrt-version", help="dry run for another device: e.g. 10.3.0")
    p.add_argument("--service", action="store_true", help="systemd ExecStartPre: settings from the environment")
    p.set_defaults(func=cmd_build_engines)

    p = subparsers.add_parser("memory-plan", help="expected GPU memory per stage for each device profile")
    p.add_argument("--bundle", help="a cosyvoice2 bundle (default: the full-size CosyVoice2-0.5B estimate)")
    _limits(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_memory_plan)

    p = subparsers.add_parser("providers", help="which ONNX Runtime execution providers really work here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_providers)


def main(argv: list[str] | None = None) -> int:
    """`python -m cosyedge.device.trt.cli ...` (until the `cosyedge` registry loads entry points)."""
    parser = argparse.ArgumentParser(prog="cosyedge")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CosyedgeError as exc:
        print(f"cosyedge: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
