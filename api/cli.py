"""CLI commands of the HTTP service; `device.cli` registers them."""
from __future__ import annotations

import argparse
import logging

from cosyedge.api.config import TARGETS


def cmd_serve(args: argparse.Namespace) -> int:
    from cosyedge.api.config import load_config
    from cosyedge.api.server import serve
    logging.getLogger().setLevel(logging.INFO)  # a service logs its lifecycle (to the journal under systemd)
    config = load_config(args.config, host=args.host, port=args.port, bundle=args.bundle, precision=args.precision,
                         target=args.target, instance=args.instance, wyoming_uri=args.wyoming)
    return serve(config)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the service's sub-command `serve` to the `cosyedge` parser."""
    p = sub.add_parser("serve", help="run the localhost HTTP API (OpenAI-compatible /v1/audio/speech and more)")
    p.add_argument("--config", help="TOML file (default: $COSYEDGE_CONFIG, else built-in defaults)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default 8100; 0 picks a free one)")
    p.add_argument("--bundle", help="bundle directory (default: the embedded default voice)")
    p.add_argument("--precision",
                   help="fp32, fp16, int8, int4 or auto (default: the best the machine and bundle offer)")
    p.add_argument("--target", choices=TARGETS, help="a build target of the bundle instead of a precision")
    p.add_argument("--instance", type=int, help="GPU index of a templated unit: the port becomes port + instance")
    p.add_argument("--wyoming", metavar="URI", help="also serve the Wyoming protocol on this loopback address with the "
                                                     "same engine and queue, e.g. tcp://127.0.0.1:10200")
    p.set_defaults(func=cmd_serve)
