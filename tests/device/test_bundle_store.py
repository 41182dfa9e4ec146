"""`cosyedge bundle install | rollback` (issue 26 item 4), the file side: checked before the switch, an atomic
pointer, the previous bundle kept, only this tool's entries pruned."""
from __future__ import annotations

import gc
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from cosyedge.device.bundle import MANIFEST, Bundle
from cosyedge.device.bundle_store import BundleStore
from cosyedge.device.engine import Engine
from cosyedge.device.errors import BundleError, InputError


def _rebuilt(source: Path, dest: Path, stamp: str) -> Path:
    """The default voice's int8 graph alone (a smaller bundle, fewer bytes to hash) under a manifest of another
    build (another `created`): another bundle hash each time."""
    manifest = json.loads((source / MANIFEST).read_text())
    manifest["components"] = [c for c in manifest["components"] if c["precision"] == "int8"]
    manifest["default_precision"], manifest["provenance"]["created"] = "int8", stamp
    dest.mkdir()
    for entry in (*manifest["components"], *manifest["assets"]):
        shutil.copyfile(source / entry["file"], dest / entry["file"])
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return dest


@pytest.fixture()
def bundles(default_bundle_path: Path, tmp_path: Path) -> list[Path]:
    return [_rebuilt(default_bundle_path, tmp_path / f"build{i}", f"2026-01-0{i}T00:00:00+00:00") for i in (1, 2, 3)]


def bundle_hash(root: Path) -> str:
    return Bundle.load(root, verify=False).sha256


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() if p.is_file() else os.readlink(p)
            for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def test_install_switches_keeps_the_previous_and_rollback_restores_its_hash(bundles, tmp_path):
    store = BundleStore(tmp_path / "store")
    first = store.install(bundles[0], load_check=False)
    assert first["current_sha256"] == bundle_hash(bundles[0]) and first["previous"] is None
    second = store.install(bundles[1])  # with the real load check
    assert second["current_sha256"] == bundle_hash(bundles[1])
    assert second["previous_sha256"] == bundle_hash(bundles[0])
    assert (tmp_path / "store" / "current").is_symlink()
    back = store.rollback()
    assert back["current_sha256"] == bundle_hash(bundles[0]) and back["previous_sha256"] == bundle_hash(bundles[1])
    assert bundle_hash(tmp_path / "store" / "current") == bundle_hash(bundles[0])  # what a loader reads
    assert store.rollback()["current_sha256"] == bundle_hash(bundles[1])  # and forward again


def test_a_tar_with_a_top_folder_installs(bundles, tmp_path):
    tar = tmp_path / "bundle.tar"
    with tarfile.open(tar, "w") as archive:
        archive.add(bundles[0], arcname="my-bundle")
    result = BundleStore(tmp_path / "store").install(tar, load_check=False)
    assert result["current_sha256"] == bundle_hash(bundles[0])


@pytest.mark.parametrize("data_filter", [True, False])
def test_a_tar_with_a_link_out_is_refused(bundles, tmp_path, monkeypatch, data_filter):
    """Both ways of unpacking (tarfile's data filter, and by hand where Python is older than 3.11.4)."""
    if not data_filter:
        monkeypatch.delattr(tarfile, "data_filter")
    tar = tmp_path / "bundle.tar"
    with tarfile.open(tar, "w") as archive:
        archive.add(bundles[0], arcname="b")
        link = tarfile.TarInfo("b/escape")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        archive.addfile(link)
    with pytest.raises(BundleError):
        BundleStore(tmp_path / "store").install(tar, load_check=False)
    assert not (tmp_path / "store" / "current").exists()


@pytest.mark.parametrize("fault", ["flipped_byte", "missing_file", "schema_version", "unknown_family", "not_a_tar"])
def test_a_corrupt_or_incompatible_bundle_is_refused_before_the_switch(bundles, tmp_path, fault):
    store = BundleStore(tmp_path / "store")
    store.install(bundles[0], load_check=False)
    store.install(bundles[1], load_check=False)
    before = _files(tmp_path / "store")
    bad = bundles[2]
    manifest = json.loads((bad / MANIFEST).read_text())
    graph = bad / manifest["components"][0]["file"]
    if fault == "flipped_byte":
        data = bytearray(graph.read_bytes())
        data[len(data) // 2] ^= 0xFF
        graph.write_bytes(bytes(data))
    elif fault == "missing_file":
        graph.unlink()
    elif fault in ("schema_version", "unknown_family"):
        manifest.update({"schema_version": 2} if fault == "schema_version" else {"family": "tacotron"})
        (bad / MANIFEST).write_text(json.dumps(manifest))
    else:
        bad = tmp_path / "bundle.tar"
        bad.write_bytes(b"this is no tar" * 100)
    with pytest.raises(BundleError):  # by the checks of the staged copy alone, before any graph is loaded
        store.install(bad, load_check=False)
    assert _files(tmp_path / "store") == before  # pointers, entries and index untouched, no staging left


def test_prune_removes_only_this_tools_retired_entries(bundles, tmp_path):
    root = tmp_path / "store"
    store = BundleStore(root)
    (root / "my-own-folder").mkdir(parents=True)
    (root / "my-own-folder" / "notes.txt").write_text("mine")
    oldest = store.install(bundles[0], load_check=False)["current"]
    store.install(bundles[1], load_check=False)
    (root / oldest / "my-file.txt").write_text("I put this here")  # a user's file inside an installed entry
    result = store.install(bundles[2], load_check=False)
    assert (root / "my-own-folder" / "notes.txt").read_text() == "mine"
    assert (root / oldest / "my-file.txt").is_file()  # holds a file the bundle does not list: left alone
    (root / oldest / "my-file.txt").unlink()
    store.install(bundles[0], load_check=False)  # back to the oldest: it is still there
    result = store.install(bundles[2], load_check=False)
    assert result["current_sha256"] == bundle_hash(bundles[2]) and result["previous_sha256"] == bundle_hash(bundles[0])
    assert len(result["entries"]) == 2  # the retired middle one was pruned
    assert (root / "my-own-folder" / "notes.txt").read_text() == "mine"


def test_prune_keeps_an_entry_a_loaded_engine_still_holds(bundles, tmp_path):
    """A worker draining on an older bundle (serve reloads when `current` moves) may still read its files: while
    an engine holds an entry, installs that retire it leave it; once the engine is gone, the next install prunes it."""
    root = tmp_path / "store"
    store = BundleStore(root)
    oldest = store.install(bundles[0], load_check=False)["current"]
    engine = Engine.load(root / "current", warmup=False)  # what the service loads
    store.install(bundles[1], load_check=False)
    store.install(bundles[2], load_check=False)  # the oldest is neither current nor previous now
    assert (root / oldest / MANIFEST).is_file() and oldest in store.entries()
    assert engine.bundle.sha256 == bundle_hash(bundles[0])
    del engine
    gc.collect()
    result = store.install(bundles[1], load_check=False)
    assert not (root / oldest).exists() and oldest not in result["entries"]


def test_the_cli_refuses_a_corrupt_bundle_in_one_line(bundles, tmp_path):
    env = {**os.environ, "COSYEDGE_BUNDLE_STORE": str(tmp_path / "store")}
    run = lambda *args: subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "bundle", *args], env=env,
                                       capture_output=True, text=True, timeout=300)
    assert run("install", str(bundles[0]), "--no-load-check").returncode == 0
    (bundles[1] / "phoneme_id_map.json").write_text("{}")
    refused = run("install", str(bundles[1]))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "does not match its sha256" in refused.stderr
    listed = json.loads(run("list").stdout)
    assert listed["current_sha256"] == bundle_hash(bundles[0]) and listed["previous"] is None
    assert run("rollback").returncode == 2  # nothing to roll back to: one line, exit 2


def test_a_store_keeps_the_mode_of_a_directory_it_did_not_make(tmp_path):
    """Only a store folder `bundle` makes gets 0755 (the service's user reads it); a user's folder keeps its own."""
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o700)
    with pytest.raises(InputError, match="no previous bundle"):  # rollback takes the store's lock first
        BundleStore(mine).rollback()
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    umask = os.umask(0o077)
    try:
        with pytest.raises(InputError, match="no previous bundle"):
            BundleStore(tmp_path / "made" / "store").rollback()
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "made" / "store").stat().st_mode) == 0o755


def test_a_store_that_cannot_be_made_is_one_line_naming_no_path(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    store = tmp_path / "a-file" / "store"
    with pytest.raises(InputError, match="bundle store 'store' cannot be created"):
        BundleStore(store).rollback()
    run = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "bundle", "rollback", "--store", str(store)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "cannot be created" in run.stderr and str(tmp_path) not in run.stderr
