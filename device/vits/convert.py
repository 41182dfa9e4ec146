"""Piper voice (ONNX + JSON) -> `vits` bundle with fp32 and int8 graphs and a measured quality report.

Torch-free on purpose: the device builds the default voice's bundle itself on first use (speaker similarity,
which needs torch, is measured only when the build host passes its measure in: `cosyedge quantize`). The
int8 graph quantizes the normalising flow only (dynamic int8, per-channel weights). The text
encoder and duration predictor stay fp32, so both precisions produce the same phoneme durations
and can be compared frame by frame; the HiFi-GAN decoder stays fp32 because int8 there costs
~5 dB of mel-cepstral distortion (measured: 5.3-5.8 dB with it, 0.7-0.8 dB without).

The converted graph differs from Piper's in four ways, all made before int8 quantization so both precisions
have them: a `seed` input drives its noise (`noise.py`), two more outputs say how long each item is (`frames`, to
cut padded batches) and how many frames each phoneme id lasts (`durations`, for word times), and its wide 1-D
convolutions are 2-D ones of height 1 (`layout.py`: ONNX Runtime's blocked kernels, where they pay).
`GRAPH_VERSION` in the manifest's config names that shape; a bundle without it was converted before the seed.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx

from cosyedge.device.bundle import sha256_file
from cosyedge.device.bundle_writer import TOOL_VERSION, BundleWriter, check_out_dir, created_now
from cosyedge.device.errors import ReleaseError
from cosyedge.device.paths import read_text
from cosyedge.device.vits.layout import wide_convolutions_as_2d
from cosyedge.device.vits.noise import seed_random_nodes

log = logging.getLogger(__name__)

QUALITY_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please stand behind the yellow line while the train arrives.",
    "Your order number is four hundred and twelve.",
    "Welcome! How can I help you today?",
)
GRAPH_VERSION = 3  # 3: wide convolutions 2-D; 2: `seed` input, `durations` output; 1 (unnamed): `frames` only
VOICE_CONFIG_MAX_BYTES = 1 << 20  # a Piper voice's .onnx.json: a few kB (its phoneme table)
MCD_GATE_DB = 2.0  # int8 is only the default precision when it is faster and stays below this MCD
NOT_MEASURED = ("resemblyzer unavailable (needs torch, so the device does not measure it); "
                "run `cosyedge quantize --force` with the [quantize] extra")


class SpeakerMeasure(Protocol):
    """Speaker similarity of two waveforms (the build host's Resemblyzer encoder); `reason` says why not."""
    available: bool
    reason: str

    def __call__(self, reference: np.ndarray, test: np.ndarray, sample_rate: int) -> float: ...


def _duration_tensors(model: onnx.ModelProto) -> tuple[str, str]:
    """The ceil'd durations (frames per phoneme id) and their ReduceSum (output frames per batch item)."""
    ceil_outputs = {out for node in model.graph.node if node.op_type == "Ceil" for out in node.output}
    for node in model.graph.node:
        if node.op_type == "ReduceSum" and node.input[0] in ceil_outputs:
            return node.input[0], node.output[0]
    raise ReleaseError("voice model: no duration (Ceil -> ReduceSum) tensor found; not a Piper VITS export")


def _write_fp32(model_path: Path, out: Path) -> onnx.ModelProto:
    try:
        model = onnx.load(str(model_path))
    except Exception as exc:  # noqa: BLE001
        raise ReleaseError(f"{model_path.name}: not a readable ONNX model ({type(exc).__name__})") from None
    durations, frames = _duration_tensors(model)
    seed_random_nodes(model)
    graph = model.graph
    graph.node.append(onnx.helper.make_node("Identity", [frames], ["frames"], name="cosyedge_frames"))
    graph.node.append(onnx.helper.make_node("Identity", [durations], ["durations"], name="cosyedge_durations"))
    graph.output.append(onnx.helper.make_tensor_value_info("frames", onnx.TensorProto.FLOAT, ["batch_size"]))
    graph.output.append(onnx.helper.make_tensor_value_info("durations", onnx.TensorProto.FLOAT,
                                                           ["batch_size", 1, "phonemes"]))
    wide_convolutions_as_2d(model)
    onnx.checker.check_model(model)
    onnx.save(model, str(out))
    return model


def _write_int8(fp32_path: Path, model: onnx.ModelProto, out: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    keep_fp32 = [n.name for n in model.graph.node if n.name.startswith(("/enc_p/", "/dp/", "/dec/"))]
    quantize_dynamic(str(fp32_path), str(out), weight_type=QuantType.QInt8, nodes_to_exclude=keep_fp32,
                     op_types_to_quantize=["MatMul", "Conv"], per_channel=True)


def build_piper_bundle(model_path: Path, config_path: Path, out: Path, measure: bool = True,
                       similarity: SpeakerMeasure | None = None) -> Path:
    """Write a complete bundle to `out` (atomically: a half-built bundle never has a manifest).

    `measure`: compare int8 with fp32 and pick the default precision; `similarity` adds speaker similarity.
    """
    model_path, config_path, out = Path(model_path), Path(config_path), Path(out)
    check_out_dir(out)
    try:
        voice = json.loads(read_text(config_path, "Piper voice config", VOICE_CONFIG_MAX_BYTES, ReleaseError))
        espeak_voice = voice["espeak"]["voice"]
        sample_rate = int(voice["audio"]["sample_rate"])
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise ReleaseError(f"{config_path.name}: not a Piper voice config ({type(exc).__name__}: {exc})") from None
    if voice.get("phoneme_type", "espeak") != "espeak":
        raise ReleaseError(f"{config_path.name}: phoneme_type {voice.get('phoneme_type')!r} is not supported (espeak only)")

    with BundleWriter(out) as writer:
        work = writer.work
        started = time.perf_counter()
        model = _write_fp32(model_path, work / "vits.fp32.onnx")
        _write_int8(work / "vits.fp32.onnx", model, work / "vits.int8.onnx")
        (work / "phoneme_id_map.json").write_text(json.dumps(voice["phoneme_id_map"], ensure_ascii=False), encoding="utf-8")
        for precision in ("fp32", "int8"):
            writer.add_component("vits", precision, f"vits.{precision}.onnx")
        writer.add_asset("phoneme_id_map", "phoneme_id_map.json")
        speakers = sorted(voice.get("speaker_id_map", {}), key=voice.get("speaker_id_map", {}).get) or [voice.get("dataset", "default")]
        inference = voice.get("inference", {})
        fields = dict(
            family="vits", name=f"piper-{voice.get('language', {}).get('code', 'xx')}-{voice.get('dataset', model_path.stem)}",
            sample_rate=sample_rate, voices=tuple(speakers), default_precision="fp32",
            config={"espeak_voice": espeak_voice, "noise_scale": inference.get("noise_scale", 0.667),
                    "length_scale": inference.get("length_scale", 1.0), "noise_w": inference.get("noise_w", 0.8),
                    "hop_length": 256, "graph_version": GRAPH_VERSION},
            provenance={"source_model": model_path.name, "source_model_sha256": sha256_file(model_path),
                        "source_config": config_path.name, "source_config_sha256": sha256_file(config_path),
                        "tool_version": TOOL_VERSION, "created": created_now(),
                        "int8_method": "onnxruntime dynamic int8, per-channel weights (MatMul, Conv) in the flow; "
                                       "text encoder, duration predictor and decoder fp32"},
        )
        writer.write_manifest(**fields)
        if measure:
            writer.write_manifest(**(fields | _measure(work, similarity)))
        log.info("built %s in %.1f s", out.name, time.perf_counter() - started)
        return writer.commit()


def _measure(root: Path, similarity: SpeakerMeasure | None) -> dict:
    """Quality of int8 against fp32 on fixed sentences, and which precision is faster here."""
    from cosyedge.device.engine import Engine
    from cosyedge.device.quality import mel_cepstral_distortion, snr_db
    from cosyedge.device.sessions import SessionConfig

    sessions = SessionConfig(providers=("cpu",))
    engines = {p: Engine.load(root, precision=p, sessions=sessions) for p in ("fp32", "int8")}
    measured = similarity is not None and similarity.available
    compute = {p: 0.0 for p in engines}
    audio_s = 0.0
    rows = []
    for sentence in QUALITY_SENTENCES:
        waves = {}
        for precision, engine in engines.items():  # interleaved, so machine noise hits both alike
            start = time.perf_counter()
            waves[precision] = engine.synthesize_waveform(sentence, deterministic=True)
            compute[precision] += time.perf_counter() - start
        audio_s += waves["fp32"].size / engines["fp32"].sample_rate
        ref, test = waves["fp32"], waves["int8"]
        row = {"text": sentence, "samples_fp32": int(ref.size), "samples_int8": int(test.size),
               "mcd_db": round(mel_cepstral_distortion(ref, test, engines["fp32"].sample_rate), 3),
               "snr_db": round(snr_db(ref, test), 2)}
        if measured:
            row["speaker_cosine"] = round(similarity(ref, test, engines["fp32"].sample_rate), 4)
        rows.append(row)
    rtf = {p: round(compute[p] / audio_s, 4) for p in compute}
    mcd = float(np.mean([r["mcd_db"] for r in rows]))
    int8_ok = mcd <= MCD_GATE_DB and all(r["samples_fp32"] == r["samples_int8"] for r in rows)
    default = "int8" if int8_ok and rtf["int8"] < rtf["fp32"] else "fp32"
    quality = {
        "reference": "fp32", "method": "same text, noise scales 0, same phoneme durations; MCD over c1..c24 (dB)",
        "gate": {"mcd_db_max": MCD_GATE_DB}, "int8": {"mean_mcd_db": round(mcd, 3), "passed": int8_ok, "sentences": rows},
        "speaker_similarity": "resemblyzer cosine" if measured else similarity.reason if similarity else NOT_MEASURED,
        "rtf_cpu": rtf, "default_precision_reason": f"{default}: "
        + ("int8 passed its gate and was faster" if default == "int8" else
           "int8 " + ("missed its quality gate" if not int8_ok else "was not faster than fp32 on this CPU")),
    }
    if measured:
        quality["int8"]["mean_speaker_cosine"] = round(float(np.mean([r["speaker_cosine"] for r in rows])), 4)
    return {"quality": quality, "default_precision": default}
