"""CLI commands of the HTTP service; `device.cli` registers them."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the service's sub-commands (`serve`) to the `cosyedge` parser."""
