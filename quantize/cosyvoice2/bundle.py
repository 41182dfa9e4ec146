"""Official CosyVoice2 release -> `cosyvoice2` bundle (fp32 graphs; layout in docs/bundle_cosyvoice2.md).

Every stage is loaded strictly from the release, exported to ONNX, and checked once more by
loading the finished bundle with the device runtime's validator.
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from cosyedge.device.bundle import sha256_file
from cosyedge.device.errors import ReleaseError
from cosyedge.device.bundle_writer import TOOL_VERSION, BundleWriter, check_out_dir, created_now
from cosyedge.quantize.cosyvoice2.flow import build_flow, fixed_noise
from cosyedge.quantize.cosyvoice2.flow_config import FlowConfig
from cosyedge.quantize.cosyvoice2.flow_export import export_flow
from cosyedge.quantize.cosyvoice2.hift import build_hift
from cosyedge.quantize.cosyvoice2.hift_export import export_hift
from cosyedge.quantize.cosyvoice2.gates import GateConfig, session
from cosyedge.quantize.cosyvoice2.llm import LLMConfig, build_llm
from cosyedge.quantize.cosyvoice2.llm_align import ALIGN_NAME, alignment_targets, export_alignment, voice_prompts
from cosyedge.quantize.cosyvoice2.llm_export import embedding_tables, export_llm
from cosyedge.quantize.cosyvoice2.precision import build_targets
from cosyedge.quantize.cosyvoice2.preset_report import bundle_presets, graph_sets, zero_shot_prompt
from cosyedge.quantize.cosyvoice2.release import YAML_NAME, Release
from cosyedge.quantize.cosyvoice2.tokenizer import write_tokenizer_json

log = logging.getLogger(__name__)

ONNX_STAND_INS = {"campplus": "campplus.onnx", "speech_tokenizer": "speech_tokenizer_v2.onnx"}
STREAM = {"hops": [25, 50, 100], "lookahead": 3, "mel_cache_frames": 8, "source_cache_samples": 3840,
          "crossfade_samples": 3840}


def _sampling(hparams: dict[str, Any], yaml_name: str = YAML_NAME) -> dict[str, float]:
    node = hparams["llm"].get("sampling")
    args = getattr(node, "args", None) or {}
    try:
        return {"top_p": float(args["top_p"]), "top_k": int(args["top_k"]), "win_size": int(args["win_size"]),
                "tau_r": float(args["tau_r"])}
    except (KeyError, TypeError, ValueError):
        raise ReleaseError(f"{yaml_name}: llm.sampling must give top_p, top_k, win_size and tau_r") from None


def _mel_config(hparams: dict[str, Any], yaml_name: str = YAML_NAME) -> dict[str, Any]:
    mel = hparams.get("feat_extractor")
    args = getattr(mel, "args", None) or {}
    try:
        return {"n_fft": int(args["n_fft"]), "hop": int(args["hop_size"]), "win": int(args["win_size"]),
                "n_mels": int(args["num_mels"]), "fmin": float(args["fmin"]),
                "fmax": None if args.get("fmax") is None else float(args["fmax"]),
                "sample_rate": int(args["sampling_rate"])}
    except (KeyError, TypeError, ValueError):
        raise ReleaseError(f"{yaml_name}: feat_extractor must give n_fft, hop_size, win_size, num_mels, fmin, fmax, "
                           "sampling_rate") from None


def write_voices(release: Release, work: Path, tokenizer_json: Path, keep_special_tokens: bool = False
                 ) -> list[tuple[str, str]]:
    """spk2info entries -> voices/<name>.npz; returns (name, file) pairs in spk2info order. The prompt text is
    decoded from its ids (`keep_special_tokens`: with markers such as CosyVoice3's `<|endofprompt|>`)."""
    if not release.has_spk2info:
        return []
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    try:
        spk2info = torch.load(release.root / "spk2info.pt", map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a broken file
        raise ReleaseError(f"spk2info.pt: cannot be read ({type(exc).__name__})") from None
    (work / "voices").mkdir()
    out = []
    for name, entry in spk2info.items():
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(name))
        flat = {k: v.detach().cpu().numpy().reshape(-1) if k != "prompt_speech_feat" else v.detach().cpu().numpy()[0]
                for k, v in entry.items() if isinstance(v, torch.Tensor)}
        if "llm_prompt_speech_token" in flat:
            ids = flat["prompt_text"].astype(np.int64)
            arrays = {"kind": np.array("zero_shot"), "prompt_text": np.array(tokenizer.decode(ids.tolist(), skip_special_tokens=not keep_special_tokens)),
                      "prompt_text_ids": ids,
                      "llm_prompt_speech_token": flat["llm_prompt_speech_token"].astype(np.int64),
                      "flow_prompt_speech_token": flat["flow_prompt_speech_token"].astype(np.int64),
                      "prompt_speech_feat": flat["prompt_speech_feat"].astype(np.float32),
                      "llm_embedding": flat["llm_embedding"].astype(np.float32),
                      "flow_embedding": flat["flow_embedding"].astype(np.float32)}
        elif "embedding" in flat:
            arrays = {"kind": np.array("sft"), "embedding": flat["embedding"].astype(np.float32)}
        else:
            raise ReleaseError(f"spk2info.pt: entry {str(name)[:40]!r} has neither an embedding nor a zero-shot prompt")
        rel = f"voices/{safe}.npz"
        np.savez(work / rel, **arrays)
        out.append((str(name), rel))
    return out


def export_stages(writer: BundleWriter, modules: dict[str, Any], exporters: dict[str, Callable[[Any, Path], dict]]
                  ) -> dict[str, float]:
    """Export each stage's module with its exporter into the bundle as fp32 components; seconds per stage."""
    timings: dict[str, float] = {}
    for stage, export in exporters.items():
        t0 = time.perf_counter()
        for name, path in export(modules[stage], writer.work).items():
            path.rename(writer.work / f"{name}.fp32.onnx")
            writer.add_component(name, "fp32", f"{name}.fp32.onnx")
        timings[stage] = round(time.perf_counter() - t0, 2)
    return timings


def copy_stand_ins(writer: BundleWriter, root: Path, stand_ins: dict[str, str]) -> None:
    """The release's own ONNX front-end models (CAM++, speech tokenizer), copied as fp32 components."""
    for name, file_name in stand_ins.items():
        shutil.copyfile(root / file_name, writer.work / f"{name}.fp32.onnx")
        writer.add_component(name, "fp32", f"{name}.fp32.onnx")


def provenance(root: Path, timings: dict[str, float]) -> dict[str, Any]:
    """Source name, tool version, export seconds and the hash of every release file the bundle came from."""
    source_files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".pt", ".onnx", ".yaml", ".json", ".txt"))
    return {"source": root.name, "tool_version": TOOL_VERSION, "created": created_now(), "export_seconds": timings,
            "source_files": {str(p.relative_to(root)): sha256_file(p) for p in source_files}}


def write_bundle(model_dir: Path | str, out: Path | str, targets: Sequence[str] = (), allow_fallback: bool = False
                 ) -> Path:
    """Build a `cosyvoice2` bundle from an official release directory; returns the bundle path.

    The fp32 graphs are always written; each of `targets` (cpu, gpu-fp16, trt-int8; see precision_targets.py) adds its
    graphs after every quantized stage passed its quality gate against fp32 (gates.py). A missed gate raises
    ReleaseError naming the stage unless `allow_fallback` (then the stage keeps a higher precision).
    """
    started = time.perf_counter()
    check_out_dir(Path(out))  # refuse a foreign directory before minutes of export
    release = Release.open(model_dir)
    llm_config, flow_config = LLMConfig.from_release(release.hparams, release.qwen_config), FlowConfig.from_hparams(release.hparams)
    modules = {"llm": build_llm(release), "flow": build_flow(release), "hift": build_hift(release)}  # strict loads first
    with BundleWriter(Path(out)) as writer:
        work = writer.work
        timings = export_stages(writer, modules, {"llm": export_llm, "flow": export_flow, "hift": export_hift})
        copy_stand_ins(writer, release.root, ONNX_STAND_INS)

        write_tokenizer_json(release.root / "CosyVoice-BlankEN", work / "tokenizer.json")
        writer.add_asset("tokenizer", "tokenizer.json")
        tables = embedding_tables(modules["llm"])
        for name, table in tables.items():
            np.save(work / f"{name}.npy", table)
            writer.add_asset(name, f"{name}.npy")
        np.save(work / "cfm_noise.npy", fixed_noise())
        writer.add_asset("cfm_noise", "cfm_noise.npy")
        voices = write_voices(release, work, work / "tokenizer.json")
        for name, rel in voices:
            writer.add_asset(f"voice:{name}", rel)
        align = export_alignment(modules["llm"], work, voice_prompts([work / rel for _, rel in voices]))
        writer.add_component(ALIGN_NAME, "fp32", align.fp32.name)
        del modules
        built = None
        if targets:
            gate_config = GateConfig(
                embed_tokens=tables["embed_tokens"], speech_embedding=tables["speech_embedding"],
                llm_embedding=tables["llm_embedding"], speech_token_size=llm_config.speech_token_size,
                token_mel_ratio=flow_config.token_mel_ratio, pre_lookahead_len=flow_config.pre_lookahead_len,
                inference_cfg_rate=flow_config.inference_cfg_rate, n_timesteps=10, noise=fixed_noise(),
                sample_rate=int(release.hparams["sample_rate"]), hift_upsample=480,
                spk_embed_dim=flow_config.spk_embed_dim)
            fp32 = {c.name: work / c.file for c in writer.components if c.name not in (*ONNX_STAND_INS, ALIGN_NAME)}
            t0 = time.perf_counter()
            built = build_targets(targets, fp32, work, gate_config, allow_fallback, log=log.info)
            for (component, precision), path in built.files.items():
                writer.add_component(component, precision, path.name)
            built.quality["alignment"] = alignment_targets(align, built.targets, writer.add_component, log.info)
            timings["targets"] = round(time.perf_counter() - t0, 2)
        del tables
        config = {"speech_token_size": llm_config.speech_token_size, "eos": llm_config.eos,
                  "stop_ids": list(llm_config.stop_ids), "min_token_text_ratio": llm_config.min_token_text_ratio,
                  "max_token_text_ratio": llm_config.max_token_text_ratio, "sampling": _sampling(release.hparams),
                  "token_mel_ratio": flow_config.token_mel_ratio, "pre_lookahead_len": flow_config.pre_lookahead_len,
                  "n_timesteps": 10, "inference_cfg_rate": flow_config.inference_cfg_rate,
                  "mel": _mel_config(release.hparams), "hift_upsample": 480,
                  "stream": {**STREAM, "lookahead": flow_config.pre_lookahead_len},  # the official streaming rule
                  "speaker_sample_rate": 16000, "tokenizer_sample_rate": 16000, "max_prompt_seconds": 30,
                  "align": align.config, **({"targets": built.targets} if built else {})}
        t0 = time.perf_counter()
        sets = graph_sets(work, built.targets if built else None,
                          {c.name: work / c.file for c in writer.components if c.precision == "fp32"})
        offered, preset_quality = bundle_presets(sets, fixed_noise(), config,
                                                 zero_shot_prompt([work / rel for _, rel in voices]), session, log.info)
        config.update(presets=offered, default_preset="official")
        timings["presets"] = round(time.perf_counter() - t0, 2)

        writer.write_manifest(
            family="cosyvoice2", name=release.root.name, sample_rate=int(release.hparams["sample_rate"]),
            voices=tuple(name for name, _ in voices), default_precision="fp32", config=config,
            quality={**(built.quality if built else {}), "presets": preset_quality},
            provenance=provenance(release.root, timings),
        )
        path = writer.commit()  # validated by the runtime's own loader first
    log.info("wrote %s in %.1f s", path.name, time.perf_counter() - started)
    return path
