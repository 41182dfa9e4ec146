"""`cosyedge wyoming`: the Wyoming server as a command (cosyedge.api.wyoming_transport listens, cosyedge.api.wyoming
handles the events), on a `Service` of its own (the admission, journal and door `serve` has, in the configuration's
state directory); imports are lazy so that `cosyedge --help` stays fast."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from cosyedge.device.engine import TARGETS
from cosyedge.device.errors import InputError
from cosyedge.device.request import WYOMING, add_flags

WYOMING_URI = "tcp://127.0.0.1:10200"


def cmd_wyoming(args: argparse.Namespace) -> int:
    from cosyedge.api.config import load_config
    from cosyedge.api.security import is_loopback
    from cosyedge.api.service import Service, load_engine
    from cosyedge.api.wyoming import WyomingTts
    from cosyedge.api.wyoming_transport import Listener, log, parse_uri
    from cosyedge.device.request import cli_values
    host, _ = parse_uri(args.uri)
    if not is_loopback(host) and not args.allow_remote:
        raise InputError(f"refusing to listen on {host}: the Wyoming protocol has no authentication; bind "
                         "127.0.0.1, or pass --allow-remote on a trusted network")
    logging.getLogger().setLevel(logging.INFO)
    config = load_config(args.config, bundle=args.bundle, precision=args.precision, target=args.target)
    service = Service(config)  # the admission, journal and door of `serve`, without HTTP
    service.start(load_engine(config))  # recovers the journal: what a killed run accepted is dead-lettered
    tts = WyomingTts(service, cli_values(args, WYOMING))

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
        await Listener(tts.connect, config).serve(
            args.uri, lambda port: log.info("wyoming: listening on tcp://%s:%d", host, port), args.zeroconf)

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        log.info("wyoming: stopped")
    finally:
        service.stop()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `cosyedge wyoming`."""
    p = sub.add_parser("wyoming", help="serve the voice over the Wyoming protocol (Home Assistant, Rhasspy)")
    p.add_argument("--uri", default=WYOMING_URI, help=f"where to listen (default {WYOMING_URI}; port 0: a free one)")
    p.add_argument("--allow-remote", action="store_true", help="listen beyond loopback (Wyoming has no authentication)")
    p.add_argument("--zeroconf", nargs="?", const="", metavar="NAME",
                   help="advertise over mDNS for Home Assistant discovery (needs the zeroconf package)")
    p.add_argument("--config", help="the service's TOML file (bundle, precision, state directory)")
    p.add_argument("--bundle", help="bundle directory (default: the embedded default voice)")
    p.add_argument("--precision", help="fp32, fp16, int8, int4 or auto")
    p.add_argument("--target", choices=TARGETS)
    add_flags(p, WYOMING)  # the defaults of every request (the request declaration's Wyoming door)
    p.set_defaults(func=cmd_wyoming)
