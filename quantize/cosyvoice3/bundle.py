"""Official Fun-CosyVoice3 release -> `cosyvoice3` bundle (fp32 graphs, plus precision targets on request; layout
in docs/bundle_cosyvoice3.md).

The CosyVoice2 writer's pieces are reused (`cosyvoice2.bundle`: stage export loop, front-end model copies, voices
from spk2info, sampling and mel config readers, provenance); what differs is the graphs (`cosyvoice3.export`,
`cosyvoice3.hift_export`), the tokenizer, the LLM tables and the HiFT noise, which is not shipped: the manifest
carries the recipe numbers (MT19937 seeded 0, draws to skip, harmonics) and the device regenerates the rows it
needs, checked against the first row stored here. Precision targets are CosyVoice2's ladders and gates with the v3 node
rules and HiFT feeds (`cosyvoice3.precision`).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from cosyedge.device.bundle_writer import BundleWriter, check_out_dir
from cosyedge.device.cosyvoice3 import family as cosyvoice3
from cosyedge.device.cosyvoice2.presets import Preset
from cosyedge.device.cosyvoice3.vocoder import SineNoise
from cosyedge.quantize.cosyvoice2.bundle import (_mel_config, _sampling, copy_stand_ins, export_stages, provenance,
                                                 write_voices)
from cosyedge.quantize.cosyvoice2.flow import N_TIMESTEPS, fixed_noise
from cosyedge.quantize.cosyvoice3 import export as E
from cosyedge.quantize.cosyvoice2.gates import GateConfig, session
from cosyedge.quantize.cosyvoice2.llm_align import ALIGN_NAME, alignment_targets, export_alignment, voice_prompts
from cosyedge.quantize.cosyvoice2.precision import TargetBuild, build_targets
from cosyedge.quantize.cosyvoice2.preset_report import bundle_presets, graph_sets, zero_shot_prompt
from cosyedge.quantize.cosyvoice3 import hift_export as HX
from cosyedge.quantize.cosyvoice3.hift_source import SINE_NOISE_ROWS
from cosyedge.quantize.cosyvoice3.models import Models, load_models
from cosyedge.quantize.cosyvoice3.precision import CV3_RULES, Gates3
from cosyedge.quantize.cosyvoice3.release import YAML_NAME
from cosyedge.quantize.cosyvoice3.tokenizer import write_tokenizer_json

log = logging.getLogger(__name__)

FAMILY = "cosyvoice3"
ONNX_STAND_INS = {"campplus": "campplus.onnx", "speech_tokenizer": "speech_tokenizer_v3.onnx"}
STREAM = {"hops": [25, 50, 100], "lookahead": 3}   # lookahead: the release's pre_lookahead_len (official rule)
SILENT_TOKENS = [1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323]   # CosyVoice3Model.silent_tokens
MAX_SILENT_RUN = 5


def hift_noise_recipe(hift: Any) -> dict[str, Any]:
    """How the device regenerates the fixed sine noise (quantize/cosyvoice3/hift_source.fixed_sine_noise)."""
    harmonics = hift.cfg.nb_harmonics + 1
    _, rows = hift.fixed_noise(1)
    return {"generator": "mt19937", "seed": 0, "draws_before": hift.noise_sizes.draws_before(),
            "harmonics": harmonics, "max_rows": SINE_NOISE_ROWS, "first_row": [float(v) for v in rows[0].numpy()]}


def _gate_config(models: Models, tables: dict[str, np.ndarray]) -> GateConfig:
    """What the quality gates need from the release (CosyVoice2's GateConfig: the graphs share signatures)."""
    c, fc = models.llm.config, models.flow.config
    return GateConfig(
        embed_tokens=tables["embed_tokens"], speech_embedding=tables["speech_embedding"],
        llm_embedding=tables["llm_embedding"], speech_token_size=c.speech_token_size,
        token_mel_ratio=fc.token_mel_ratio, pre_lookahead_len=fc.pre_lookahead_len,
        inference_cfg_rate=fc.inference_cfg_rate, n_timesteps=N_TIMESTEPS, noise=fixed_noise(),
        sample_rate=int(models.release.hparams["sample_rate"]), hift_upsample=models.hift.cfg.samples_per_frame,
        spk_embed_dim=fc.spk_embed_dim)


def _build_targets(writer: BundleWriter, targets: Sequence[str], allow_fallback: bool, config: GateConfig,
                   noise_recipe: dict[str, Any]) -> TargetBuild:
    """Every target's graphs from the fp32 components in the writer, each quantized stage gated against fp32."""
    fp32 = {comp.name: writer.work / comp.file for comp in writer.components
            if comp.name not in (*ONNX_STAND_INS, ALIGN_NAME)}
    gates = Gates3(config, fp32, SineNoise(noise_recipe, config.sample_rate))
    built = build_targets(targets, fp32, writer.work, config, allow_fallback, log=log.info, rules=CV3_RULES,
                          gates=gates)
    for (component, precision), path in built.files.items():
        writer.add_component(component, precision, path.name)
    return built


def write_bundle(model_dir: Path | str, out: Path | str, targets: Sequence[str] = (), allow_fallback: bool = False,
                 candidates: dict[str, Preset] | None = None) -> Path:
    """Build a `cosyvoice3` bundle from an official release directory; returns the bundle path.

    fp32 graphs always; each of `targets` (cpu, gpu-fp16, trt-int8) adds the graphs whose stages passed their
    quality gates against fp32 (a miss raises ReleaseError naming the stage unless `allow_fallback`). The flow
    presets (`candidates`, default the built-ins) are measured on every graph set with the v3 vocoder and only the
    passing ones offered, as for CosyVoice2 (quantize/cosyvoice2/preset_report.py)."""
    started = time.perf_counter()
    check_out_dir(Path(out))  # refuse a foreign directory before minutes of export
    models = load_models(model_dir)  # strict loads of every checkpoint first
    release, lm, flow, hift = models.release, models.llm, models.flow, models.hift
    with BundleWriter(Path(out)) as writer:
        work = writer.work
        timings = export_stages(writer, {"llm": lm, "flow": flow, "hift": hift},
                                {"llm": E.export_llm, "flow": E.export_flow, "hift": HX.export_hift})
        copy_stand_ins(writer, release.root, ONNX_STAND_INS)
        write_tokenizer_json(release.root / "CosyVoice-BlankEN", work / "tokenizer.json")
        writer.add_asset("tokenizer", "tokenizer.json")
        c = lm.config
        tables = E.embedding_tables(lm)
        # sos and task_id rows of speech_embedding as CosyVoice2's [2, H] table: the runtime assembles lm_input alike
        tables["llm_embedding"] = np.ascontiguousarray(tables["speech_embedding"][[c.sos, c.task_id]])
        for name, table in tables.items():
            np.save(work / f"{name}.npy", table)
            writer.add_asset(name, f"{name}.npy")
        np.save(work / "cfm_noise.npy", fixed_noise())
        writer.add_asset("cfm_noise", "cfm_noise.npy")
        voices = write_voices(release, work, work / "tokenizer.json", keep_special_tokens=True)
        for name, rel in voices:
            writer.add_asset(f"voice:{name}", rel)
        align = export_alignment(lm, work, voice_prompts([work / rel for _, rel in voices]))
        writer.add_component(ALIGN_NAME, "fp32", align.fp32.name)
        fc = flow.config
        noise_recipe = hift_noise_recipe(hift)
        config = {"speech_token_size": c.speech_token_size, "sos": c.sos, "eos": c.eos, "task_id": c.task_id,
                  "stop_ids": list(c.stop_ids), "min_len_masked_id": c.min_len_masked_id,
                  "min_token_text_ratio": c.min_token_text_ratio, "max_token_text_ratio": c.max_token_text_ratio,
                  "sampling": _sampling(release.hparams, YAML_NAME),
                  "token_mel_ratio": fc.token_mel_ratio, "pre_lookahead_len": fc.pre_lookahead_len,
                  "n_timesteps": N_TIMESTEPS, "inference_cfg_rate": fc.inference_cfg_rate,
                  "estimator_chunk": fc.estimator.static_chunk_size,
                  "flow_sizes": {"estimator_heads": fc.estimator.heads, "estimator_width": fc.estimator.dim,
                                 "encoder_heads": 0, "encoder_width": fc.pre_lookahead_channels},
                  "mel": _mel_config(release.hparams, YAML_NAME), "hift_upsample": hift.cfg.samples_per_frame,
                  "hift_f0_lookahead": hift.f0_predictor.lookahead,
                  "hift_conv_pre_lookahead": hift.cfg.conv_pre_look_right,
                  "hift_history_frames": HX.decoder_history_frames(hift),
                  "hift_noise": noise_recipe, "stream": {**STREAM, "lookahead": fc.pre_lookahead_len},
                  "silent_tokens": SILENT_TOKENS, "max_silent_run": MAX_SILENT_RUN,
                  "instruct2_saved_speaker_quirk": True,
                  "speaker_sample_rate": 16000, "tokenizer_sample_rate": 16000, "max_prompt_seconds": 30,
                  "align": align.config}
        gate_config = _gate_config(models, tables) if targets else None
        del models, lm, flow, hift   # full size: the torch modules go before the gates load their graphs
        built = None
        if gate_config is not None:
            t0 = time.perf_counter()
            built = _build_targets(writer, targets, allow_fallback, gate_config, noise_recipe)
            built.quality["alignment"] = alignment_targets(align, built.targets, writer.add_component, log.info)
            config["targets"] = built.targets
            timings["targets"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        sets = graph_sets(work, built.targets if built else None,
                          {c.name: work / c.file for c in writer.components if c.precision == "fp32"})
        offered, preset_quality = bundle_presets(sets, fixed_noise(), config,
                                                 zero_shot_prompt([work / rel for _, rel in voices]), session, log.info,
                                                 vocoder_part=cosyvoice3.vocoder, candidates=candidates)
        config.update(presets=offered, default_preset="official")
        timings["presets"] = round(time.perf_counter() - t0, 2)
        writer.write_manifest(family=FAMILY, name=release.root.name, sample_rate=int(release.hparams["sample_rate"]),
                              voices=tuple(name for name, _ in voices), default_precision="fp32", config=config,
                              quality={**(built.quality if built else {}), "presets": preset_quality},
                              provenance=provenance(release.root, timings))
        path = writer.commit()  # validated by the runtime's own loader first
    log.info("wrote %s in %.1f s", path.name, time.perf_counter() - started)
    return path
