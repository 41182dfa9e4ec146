"""synth-batch on a Ray cluster (issue 22 item 4): a real local cluster on loopback, the default voice,
--deterministic. The actors' files are the local job's, byte for byte; an actor killed mid-job (ray.kill, or a
SIGKILL of its worker process) loses no line and writes none twice; a rerun skips every line; the command line
starts and ends a throwaway cluster of its own, or uses the one `ray start --head` made and leaves it running;
bench-batch measures one engine and a cluster in one run. (Ray missing: tests/device/test_cli.py.)"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import soundfile as sf

if importlib.util.find_spec("ray") is None:  # not importorskip: `cluster` must be the first to import ray
    pytest.skip("Ray is not installed: pip install 'cosyedge[ray]' (make buildhost installs it)",
                allow_module_level=True)

from cosyedge.device import ray_jobs, request  # noqa: E402
from cosyedge.device.jobs import DEAD_LETTER, Line, run_job  # noqa: E402

pytestmark = pytest.mark.slow

LINES = [Line("intro", "One small line. And a second sentence after it."), Line("b", "Two small lines."),
         Line("c", "Three small lines! Really? Yes, really."), Line("d", "Four."),
         Line("e", "The fifth line is a little longer than the others, with a clause.")]
MANY = [Line(f"n{i:02d}", f"Line number {i} of the long job. It has two sentences.") for i in range(12)]


def _files(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.iterdir()) if path.name != DEAD_LETTER}


def _cosyedge(*args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cosyedge.device.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "COSYEDGE_HOME": str(home)}, timeout=300)


def test_the_command_runs_the_job_on_a_throwaway_local_cluster(default_bundle_path, tmp_path):
    """`--ray local --actors 2`: the cluster starts, two engines render, the summary is the job's (and the
    actors'), and the command ends with its cluster."""
    book = tmp_path / "book.txt"
    book.write_text("One small line.\nTwo small lines.\nThree small lines.\n")
    out = tmp_path / "out"
    result = _cosyedge("synth-batch", str(book), "--out-dir", str(out), "--bundle", str(default_bundle_path),
                       "--precision", "fp32", "--deterministic", "--ray", "local", "--actors", "2", "--quiet",
                       home=default_bundle_path.parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary == {**summary, "total": 3, "done": 3, "failed": 0, "actors": 2, "actors_lost": 0}
    assert sorted(_files(out)) == ["000001.wav", "000002.wav", "000003.wav"]
    assert (out / DEAD_LETTER).read_text() == ""


def test_the_command_runs_the_job_on_a_running_cluster_and_leaves_it_running(default_bundle_path, tmp_path):
    """`--ray HOST:PORT`: a cluster started by `ray start --head` (loopback, no dashboard, a temporary directory
    of its own) renders the job, and is still there after it for the next one."""
    temp = Path(tempfile.mkdtemp(prefix="cosyedge-head-"))  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--port=0", "--num-cpus=2",
                             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}", "--block"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (temp / "ray_current_cluster").is_file() and head.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        address = (temp / "ray_current_cluster").read_text().split()[0]
        assert address.startswith("127.0.0.1:")
        book = tmp_path / "book.txt"
        book.write_text("One small line.\nTwo small lines.\n")
        for run in range(2):
            result = subprocess.run(
                [sys.executable, "-m", "cosyedge.device.cli", "synth-batch", str(book), "--out-dir",
                 str(tmp_path / "out"), "--bundle", str(default_bundle_path), "--precision", "fp32", "--ray", address,
                 "--quiet"],
                capture_output=True, text=True, timeout=300,
                env={**os.environ, "COSYEDGE_HOME": str(default_bundle_path.parents[1]), "RAY_AUTH_MODE": "token"})
            assert result.returncode == 0, result.stderr[-3000:]
            summary = json.loads(result.stdout.strip().splitlines()[-1])
            assert summary == {**summary, "total": 2, "done": 2 - 2 * run, "skipped": 2 * run, "actors": 1}
        assert head.poll() is None  # the job only left the cluster
    finally:
        head.terminate()  # `ray start --block` stops its node's processes on SIGTERM
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)
        shutil.rmtree(temp, ignore_errors=True)


def test_bench_batch_reports_every_run_and_their_files_are_the_same(default_bundle_path, tmp_path):
    """`cosyedge bench-batch` (issue 22 item 5): in flight 1 and 2 on one engine, then two actors on a local
    cluster, in one run; the JSON has a row per run with its throughput, and every run made the same files."""
    book = tmp_path / "book.txt"
    book.write_text("One small line.\nTwo small lines.\nThree small lines! Really? Yes.\nFour.\n")
    result = _cosyedge("bench-batch", str(book), "--bundle", str(default_bundle_path), "--precision", "fp32",
                       "--in-flight", "1,2", "--actors", "2", "--threads", "1", "--out-dir", str(tmp_path / "runs"),
                       "--json", str(tmp_path / "bench.json"), "--sample-rate", "24000",
                       home=default_bundle_path.parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["request"] == {"sample_rate": 24000, "deterministic": True}  # the request flags, every run's
    assert [r["run"] for r in report["runs"]] == ["in-flight-1", "in-flight-2", "ray-2-actors"]
    assert [(r["engines"], r["threads"], r["in_flight"]) for r in report["runs"]] == [(1, 1, 1), (1, 1, 2), (2, 1, 2)]
    for row in report["runs"]:
        assert row["lines"] == 4 and row["failed"] == 0 and row["audio_s"] > 1
        assert row["lines_per_hour"] > 0 and row["audio_s_per_s"] > 0 and 0 < row["rtf"] < 10
        assert row["rtf"] == pytest.approx(row["wall_s"] / row["audio_s"], rel=0.1, abs=0.01)
    assert report["identical"] is True and report["differ"] == []
    runs = [_files(tmp_path / "runs" / r["run"]) for r in report["runs"]]
    assert len(runs[0]) == 4 and all(files == runs[0] for files in runs)
    assert {sf.info(str(p)).samplerate for p in (tmp_path / "runs" / "ray-2-actors").glob("*.wav")} == {24000}
    assert "ray-2-actors" in result.stdout and "byte-identical" in result.stdout  # the table


@pytest.fixture(scope="module")
def ray_cluster():
    """A two-CPU cluster in this process, on 127.0.0.1 with no dashboard (the job's own `cluster`)."""
    with ray_jobs.cluster("local", cpus=2) as ray:
        yield ray


@pytest.fixture(scope="module")
def actors(ray_cluster, default_bundle_path):
    """Two engines of one thread each (the local engine's thread count: ORT's float sums follow it), two lines
    in flight on each."""
    pool = ray_jobs.Actors(ray_cluster, {"deterministic": True}, bundle=default_bundle_path, precision="fp32",
                           count=2, in_flight=2)
    assert pool.cpus == 1
    yield pool
    pool.close()


def test_actors_write_the_local_job_s_files_and_a_rerun_skips_them(actors, default_engine, tmp_path):
    job = request.parse({"deterministic": True}, request.SYNTH_BATCH, default_engine)
    local = run_job(default_engine, LINES, tmp_path / "local", job, progress=False, in_flight=1, subtitles="vtt")
    summary = ray_jobs.run_on_ray(actors, LINES, tmp_path / "ray", subtitles="vtt", progress=False)
    assert summary == {**summary, "total": len(LINES), "done": len(LINES), "failed": 0, "skipped": 0, "actors": 2}
    assert summary["in_flight"] == 4 and summary["audio_s"] == pytest.approx(local["audio_s"], abs=0.01)
    assert _files(tmp_path / "ray") == _files(tmp_path / "local")  # byte for byte, subtitles too
    again = ray_jobs.run_on_ray(actors, LINES, tmp_path / "ray", subtitles="vtt", progress=False)
    assert again == {**again, "total": len(LINES), "skipped": len(LINES), "done": 0, "failed": 0}
    assert (tmp_path / "ray" / DEAD_LETTER).read_text() == ""


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_an_actor_killed_mid_job_loses_nothing_and_doubles_nothing(actors, ray_cluster, tmp_path, monkeypatch, how):
    placed: Counter[str] = Counter()
    place = ray_jobs.place

    def counted(target: Path, *args):
        placed[target.name] += 1
        return place(target, *args)

    monkeypatch.setattr(ray_jobs, "place", counted)
    out, lost, result = tmp_path / "out", actors.lost, {}
    runner = threading.Thread(target=lambda: result.update(ray_jobs.run_on_ray(actors, MANY, out, progress=False)))
    runner.start()
    deadline = time.monotonic() + 120
    while not list(out.glob("*.wav")) and time.monotonic() < deadline:  # mid-job: the first line is written
        time.sleep(0.02)
    victim = actors.handles[0]
    if how == "ray.kill":
        ray_cluster.kill(victim)
    else:
        os.kill(ray_cluster.get(victim.pid.remote(), timeout=30), signal.SIGKILL)
    runner.join(180)
    assert not runner.is_alive()
    assert result == {**result, "total": len(MANY), "done": len(MANY), "failed": 0, "skipped": 0}
    assert actors.lost == lost + 1 and actors.handles[0] is not victim  # replaced, and the job went on
    assert placed == Counter({f"{line.key}.wav": 1 for line in MANY})  # each line written once, by the driver
    assert sorted(_files(out)) == sorted(f"{line.key}.wav" for line in MANY) and not list(out.glob(".*"))
    assert (out / DEAD_LETTER).read_text() == ""


def test_bench_batch_measures_several_thread_counts_in_one_run(default_bundle_path, tmp_path):
    """`--threads 1,2`: one engine per thread count, each at every --in-flight (run names say the count); files are
    compared within a thread count (ORT's sums follow the threads); bad counts are one line, exit 2."""
    book = tmp_path / "book.txt"
    book.write_text("One small line.\nTwo small lines.\nThree.\n")
    result = _cosyedge("bench-batch", str(book), "--bundle", str(default_bundle_path), "--precision", "fp32",
                       "--in-flight", "1,2", "--actors", "0", "--threads", "1,2", "--json", str(tmp_path / "b.json"),
                       home=default_bundle_path.parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "b.json").read_text())
    assert [(r["run"], r["threads"], r["in_flight"]) for r in report["runs"]] == [
        ("in-flight-1-t1", 1, 1), ("in-flight-2-t1", 1, 2), ("in-flight-1-t2", 2, 1), ("in-flight-2-t2", 2, 2)]
    assert report["threads_per_engine"] == [1, 2] and report["identical"] is True
    assert all(r["lines"] == 3 and r["audio_s_per_s"] > 0 for r in report["runs"])
    assert "of a thread count byte-identical" in result.stdout
    for bad in ("0", "1,1", "x"):
        refused = _cosyedge("bench-batch", str(book), "--actors", "0", "--threads", bad,
                            home=default_bundle_path.parents[1])
        assert refused.returncode == 2 and "--threads" in refused.stderr and "Traceback" not in refused.stderr
