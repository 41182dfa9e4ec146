"""Bundle updates with rollback: `cosyedge bundle install | rollback | list`.

A store is a directory of bundles this tool installed and two pointers:

    <name>-<hash12>/    an installed bundle (hash: the sha256 of its manifest.json, which lists every file's sha256)
    current -> ...      what the service loads (COSYEDGE_BUNDLE=<store>/current); switched by an atomic rename
    previous -> ...     the bundle before it; `rollback` swaps the two
    store.json          the entries this tool installed: the only folders it ever removes

`install` checks a bundle (manifest version and family, every file's hash, and a real load) in a staging folder
beside the others, so a corrupt or incompatible bundle is refused before anything the service reads changes.
A running `cosyedge serve` watches `current` and reloads when it moves (api/service.py). After a switch, entries
that are neither current nor previous are pruned, and only if they still hold nothing but their listed files and no
process holds them: every loaded `Engine` holds its bundle (`hold`: a shared lock on its manifest, let go when the
engine or its process ends), so a worker still draining on an older bundle keeps it until it exits; the next
install prunes it then.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import tarfile
import tempfile
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Iterator

from cosyedge.device.bundle import MANIFEST, Bundle, only_listed_files
from cosyedge.device.errors import BundleError, InputError
from cosyedge.device.paths import make_dir, state_dir

STORE_ENV = "COSYEDGE_BUNDLE_STORE"
INDEX = "store.json"
POINTERS = ("current", "previous")


def store_dir(path: str | Path | None = None) -> Path:
    """`--store`, else `COSYEDGE_BUNDLE_STORE` (the appliance sets it), else `<state dir>/store`."""
    return Path(path or os.environ.get(STORE_ENV) or state_dir() / "store")


def hold(root: Path) -> IO[bytes] | None:
    """Mark the bundle at `root` in use for as long as the returned file stays open: a shared lock on its manifest,
    opened read-only (the service cannot write the store). `install` never prunes a held entry. None where the
    manifest cannot be opened (then nothing is held)."""
    try:
        handle = (root / MANIFEST).open("rb")
    except OSError:
        return None
    fcntl.flock(handle, fcntl.LOCK_SH)
    return handle


def copy_bundle(source: Path, dest: Path) -> Bundle:
    """Copy a bundle's manifest and the files it lists to `dest` (nothing else), checking every hash on both
    sides; the copy is returned loaded."""
    bundle = Bundle.load(source, verify=True)
    files = [MANIFEST, *(entry.file for entry in (*bundle.manifest.components, *bundle.manifest.assets))]
    for rel in dict.fromkeys(files):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bundle.path(rel), target)
    return Bundle.load(dest, verify=True)


def _bundle_root(folder: Path) -> Path:
    """The bundle inside an unpacked tar: its top, or the one folder at its top."""
    if (folder / MANIFEST).is_file():
        return folder
    inner = [p for p in folder.iterdir() if p.is_dir()]
    if len(inner) == 1 and (inner[0] / MANIFEST).is_file():
        return inner[0]
    raise BundleError(f"the archive holds no bundle ({MANIFEST} at its top or in its one folder)")


def _extract(tar: tarfile.TarFile, dest: Path) -> None:
    """Plain files and folders only, all inside `dest`: tarfile's "data" filter where this Python has it (3.11.4+),
    else the same refusals by hand (Ubuntu 22.04's python3.11 is 3.11.0)."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
        return
    members = tar.getmembers()
    for member in members:
        if not (member.isfile() or member.isdir()) or member.name.startswith("/") or ".." in Path(member.name).parts:
            raise BundleError(f"the archive holds {member.name!r}, which is not a plain file inside it; refused")
    tar.extractall(dest, members=members)


class BundleStore:
    """The store at `root`; every change holds its lock (two installs never interleave)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        make_dir(self.root, "bundle store", mode=0o755)  # one it makes: the service reads it; a user's keeps its mode
        with (self.root / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def entries(self) -> dict[str, dict]:
        try:
            return json.loads((self.root / INDEX).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            raise BundleError(f"bundle store {self.root.name!r}: {INDEX} is unreadable; nothing was changed") from None

    def _save(self, entries: dict[str, dict]) -> None:
        partial = self.root / f".{INDEX}.partial"
        partial.write_text(json.dumps(entries, indent=2) + "\n", encoding="utf-8")
        partial.replace(self.root / INDEX)

    def pointer(self, name: str) -> str | None:
        """The entry `current` or `previous` names, if any."""
        link = self.root / name
        return os.readlink(link) if link.is_symlink() else None

    def _point(self, name: str, entry: str) -> None:
        """Move a pointer atomically: a new link, renamed over the old one."""
        partial = self.root / f".{name}.partial"
        partial.unlink(missing_ok=True)
        partial.symlink_to(entry)
        partial.replace(self.root / name)

    def install(self, source: Path, switch: bool = True, precision: str = "auto", target: str | None = None,
                load_check: bool = True) -> dict:
        """Check `source` (a bundle folder or a tar of one), add it, and (with `switch`) make it current."""
        source = Path(source)
        if not source.exists():
            raise InputError(f"{source.name!r} not found: give a bundle folder or a .tar of one")
        with self._locked():
            entries = self.entries()
            staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=self.root))
            try:
                bundle = self._stage(source, staging / "bundle")
                if load_check:  # incompatible (a family, precision or target this runtime cannot run): refused here
                    from cosyedge.device.engine import Engine
                    Engine.load(bundle.root, precision=precision, target=target)  # graphs made, one warm-up run
                digest = bundle.sha256
                entry = f"{re.sub(r'[^A-Za-z0-9._-]+', '_', bundle.manifest.name)}-{digest[:12]}"
                if entry not in entries or not (self.root / entry).is_dir():
                    if (self.root / entry).exists():
                        raise BundleError(f"bundle store: {entry!r} exists and is not this tool's; nothing was changed")
                    for path in (bundle.root, *(p for p in bundle.root.rglob("*"))):
                        path.chmod(0o755 if path.is_dir() else 0o644)  # the service's user reads it
                    bundle.root.rename(self.root / entry)
                    entries[entry] = {"name": bundle.manifest.name, "sha256": digest, "family": bundle.manifest.family,
                                      "installed": datetime.now(timezone.utc).isoformat(timespec="seconds")}
                    self._save(entries)
            finally:
                shutil.rmtree(staging, ignore_errors=True)  # our own mkdtemp: a refused bundle leaves nothing
            switched = switch or self.pointer("current") is None
            if switched and self.pointer("current") != entry:
                if self.pointer("current") is not None:
                    self._point("previous", self.pointer("current"))
                self._point("current", entry)
                self._prune(entries)
            return self.status() | {"installed": entry, "switched": switched}

    def _stage(self, source: Path, dest: Path) -> Bundle:
        if source.is_dir():
            return copy_bundle(source, dest)
        unpacked = dest.with_name("unpacked")
        unpacked.mkdir()
        try:
            with tarfile.open(source) as tar:
                _extract(tar, unpacked)
        except (tarfile.TarError, OSError) as exc:
            raise BundleError(f"{source.name!r} is not a readable tar ({type(exc).__name__})") from None
        return copy_bundle(_bundle_root(unpacked), dest)

    def rollback(self) -> dict:
        """Swap current and previous (a second rollback goes forward again)."""
        with self._locked():
            current, previous = self.pointer("current"), self.pointer("previous")
            if previous is None or not (self.root / previous).is_dir():
                raise InputError("no previous bundle to roll back to")
            self._point("current", previous)
            self._point("previous", current)
            return self.status()

    def _prune(self, entries: dict[str, dict]) -> None:
        """Remove installed entries that are neither current nor previous; a folder that holds anything besides
        its bundle's files (or is not in the index), or that a process holds (`hold`), is left alone."""
        keep = {self.pointer(name) for name in POINTERS}
        for entry in [e for e in entries if e not in keep]:
            folder = self.root / entry
            files = only_listed_files(folder) if folder.is_dir() and not folder.is_symlink() else None
            if files is None:
                continue
            with (folder / MANIFEST).open("rb") as manifest:
                try:  # held through the removal: no engine starts holding it meanwhile
                    fcntl.flock(manifest, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # an engine (a draining worker) still uses it
                for path in files:
                    path.unlink()
                for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                                  reverse=True):
                    sub.rmdir()
                folder.rmdir()
            del entries[entry]
        self._save(entries)

    def status(self) -> dict:
        entries = self.entries()
        return {"store": str(self.root), **{name: self.pointer(name) for name in POINTERS},
                **{f"{name}_sha256": entries.get(self.pointer(name) or "", {}).get("sha256") for name in POINTERS},
                "entries": sorted(entries)}


def register(sub: argparse._SubParsersAction) -> None:
    """Entry point `cosyedge.commands: bundle`."""
    p = sub.add_parser("bundle", help="install a bundle beside the current one, switch to it, roll back")
    actions = p.add_subparsers(dest="bundle_command", required=True)
    install = actions.add_parser("install", help="check a bundle (folder or .tar) and make it the current one")
    install.add_argument("source")
    install.add_argument("--no-switch", action="store_true",
                         help="add it only (the first bundle still becomes current)")
    install.add_argument("--precision", default="auto", help="the load check uses this precision (as serve would)")
    install.add_argument("--target", help="the load check uses this build target (as serve would)")
    install.add_argument("--no-load-check", action="store_true",
                         help="check manifest and hashes only, without loading the graphs (saves memory)")
    actions.add_parser("rollback", help="make the previous bundle current again")
    actions.add_parser("list", help="the store's bundles and pointers")
    for action in actions.choices.values():
        action.add_argument("--store", help=f"the store directory (default: ${STORE_ENV}, else <state dir>/store)")
    p.set_defaults(func=cmd_bundle)


def cmd_bundle(args: argparse.Namespace) -> int:
    store = BundleStore(store_dir(args.store))
    if args.bundle_command == "install":
        result = store.install(Path(args.source), switch=not args.no_switch, precision=args.precision,
                               target=args.target, load_check=not args.no_load_check)
    elif args.bundle_command == "rollback":
        result = store.rollback()
    else:
        result = store.status()
    print(json.dumps(result, indent=2))
    return 0
