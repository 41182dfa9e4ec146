"""Random-weight Fun-CosyVoice3 releases (quantize/cosyvoice3/random_init.py): the full-size preset has the sizes of
the facts sheet (B2), and a release re-sized to dimensions the shared tiny release does not have loads, exports
(fp32 and the cpu target) and speaks end to end, which proves every size is read from the files."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.device.families import load_pipeline
from cosyedge.device.options import SynthesisOptions
from cosyedge.device.sessions import SessionConfig
from cosyedge.quantize.cosyvoice2.random_init import _sized_yaml
from cosyedge.quantize.cosyvoice2.release import read_yaml
from cosyedge.quantize.cosyvoice3.bundle import write_bundle
from cosyedge.quantize.cosyvoice3.flow import Flow3Config
from cosyedge.quantize.cosyvoice3.hift import HiFT3Config
from cosyedge.quantize.cosyvoice3.models import load_models
from cosyedge.quantize.cosyvoice3.random_init import PRESETS, write_random_release
from cosyedge.quantize.cosyvoice3.release import YAML_NAME

# none of these equals the tiny release's (LLM 24 / 2 layers / 3 heads; PreLookahead 32; DiT 64 x 2, 4 x 16 heads;
# HiFT 32, f0 32); GQA group 5, odd head counts, a hidden size that is no multiple of the int8 block (32)
OTHER = {"yaml": {"llm_input_size": "40", "llm_output_size": "40", "channels": "48", "dim": "96", "depth": "3",
                  "heads": "6", "dim_head": "16", "base_channels": "48", "cond_channels": "40"},
         "qwen": {"hidden_size": 40, "intermediate_size": 96, "num_attention_heads": 5, "num_hidden_layers": 3,
                  "num_key_value_heads": 1, "max_window_layers": 3}}


def test_full_size_preset_has_the_official_sizes(cv3_tiny_dir: Path, tmp_path: Path) -> None:
    spec = PRESETS["cosyvoice3-0.5b"]
    (tmp_path / YAML_NAME).write_text(_sized_yaml((cv3_tiny_dir / YAML_NAME).read_text(encoding="utf-8"),
                                                  spec["yaml"]), encoding="utf-8")
    hparams = read_yaml(tmp_path / YAML_NAME)
    flow, hift = Flow3Config.from_hparams(hparams), HiFT3Config.from_release_hparams(hparams)
    dit = flow.estimator
    assert (dit.dim, dit.depth, dit.heads, dit.dim_head, dit.ff_mult) == (1024, 22, 16, 64, 2)
    assert flow.pre_lookahead_channels == 1024 and (hift.base_channels, hift.f0_cond_channels) == (512, 512)
    assert int(hparams["llm_input_size"]) == int(hparams["llm_output_size"]) == 896
    q = spec["qwen"]
    assert (q["hidden_size"], q["num_hidden_layers"], q["num_attention_heads"], q["num_key_value_heads"],
            q["intermediate_size"]) == (896, 24, 14, 2, 4864)


def test_cli_random_init_routes_presets(cv3_tiny_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "COSYEDGE_HOME": str(tmp_path / "home")}
    result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "quantize", "--random-init", "cosyvoice3-9b",
                             "--template", str(cv3_tiny_dir), "--out", str(tmp_path / "r")], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 2 and "cosyvoice3-0.5b" in result.stderr and "cosyvoice2-0.5b" in result.stderr
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def other(cv3_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cv3other")
    release = write_random_release(OTHER, cv3_tiny_dir, root / "release")
    return release, write_bundle(release, root / "bundle", targets=["cpu"], allow_fallback=True)


def test_other_sizes_load_from_the_files(other) -> None:
    models = load_models(other[0])
    assert models.llm.config.qwen.hidden_size == 40 and models.llm.config.qwen.num_layers == 3
    assert models.llm.config.qwen.num_kv_heads == 1 and models.llm.config.qwen.head_dim == 8
    dit = models.flow.config.estimator
    assert (dit.dim, dit.depth, dit.heads) == (96, 3, 6) and models.flow.config.pre_lookahead_channels == 48
    assert (models.hift.cfg.base_channels, models.hift.cfg.f0_cond_channels) == (48, 40)


def test_other_sizes_export_and_speak(other) -> None:
    bundle = Bundle.load(other[1])
    cfg = bundle.manifest.config
    assert np.load(bundle.asset("speech_embedding")).shape == (6761, 40)
    # the HiFT noise offset depends on the f0 predictor's width: the recipe was recomputed, not copied
    assert cfg["hift_noise"]["draws_before"] != 1763041
    assert set(cfg["targets"]) == {"cpu"} and cfg["targets"]["cpu"]["stages"]["llm"] == "int8"
    for selection in ("fp32", "cpu"):
        pipeline = load_pipeline(bundle, selection, SessionConfig(providers=("cpu",), intra_op_threads=1))
        request = SynthesisOptions(voice="zs_full", sampling="greedy", deterministic=True)
        segments = pipeline.segments(pipeline.validate_text("Hello there, this is another size.", 1000))
        tokens = pipeline.speech_tokens(segments[0], request)
        assert tokens and max(tokens) < 6561
        (wave,) = pipeline.synthesize(segments[:1], request)
        kept = len(pipeline._flow_tokens(tokens))
        assert wave.size == kept * 2 * 480 and np.isfinite(wave).all() and np.abs(wave).max() > 0
        chunks = list(pipeline.stream_tokens(tokens, request))
        assert sum(c.size for c in chunks) == wave.size
