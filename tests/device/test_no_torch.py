"""The runtime install must never need torch: run it in a process where `import torch` fails."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

def run_without_torch(code: str, env: dict[str, str], home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "COSYEDGE_HOME": str(home)}, timeout=300)


def test_blocker_really_blocks(torch_blocked_env, default_bundle_path):
    result = run_without_torch("import torch", torch_blocked_env, default_bundle_path.parents[1])
    assert result.returncode != 0 and "forbidden" in result.stderr


def test_runtime_and_api_work_without_torch(torch_blocked_env, default_bundle_path):
    code = (
        "import cosyedge.device.engine, cosyedge.device.cli, cosyedge.device.jobs\n"
        "import cosyedge.device.bench.cli, cosyedge.device.bench.cosyvoice, cosyedge.device.bench.worker\n"
        "import cosyedge.device.bench.engine, cosyedge.device.bench.graphs, cosyedge.device.bench.decode\n"
        "import cosyedge.api.app, cosyedge.api.server, cosyedge.api.admission\n"
        "from cosyedge.device.engine import Engine\n"
        "e = Engine.load()\n"
        "assert e.synthesize('No torch here.', deterministic=True).duration_seconds > 0.5\n"
        "import sys; assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    result = run_without_torch(code, torch_blocked_env, default_bundle_path.parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_first_use_build_of_default_voice_without_torch(torch_blocked_env, tmp_path):
    """A fresh box builds the default bundle with no torch (quality measured without the speaker encoder)."""
    home = tmp_path / "fresh"
    code = (
        "from cosyedge.device.vits.default_voice import default_bundle\n"
        "from cosyedge.device.bundle import Bundle\n"
        "m = Bundle.load(default_bundle()).manifest\n"
        "assert 'resemblyzer unavailable' in m.quality['speaker_similarity'], m.quality['speaker_similarity']\n"
        "print('ok', m.default_precision)\n"
    )
    result = run_without_torch(code, torch_blocked_env, home)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ok")
