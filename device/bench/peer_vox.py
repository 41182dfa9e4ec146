"""`cosyedge bench --peer vox`: vox-tts, an independent C++ engine (PyPI `vox-tts`, module `vox`, numpy only), on the
release the bundle came from, interleaved with our device engine like piper-tts beside the default voice.

The bench starts this module as one more worker (`python -m cosyedge.device.bench.peer_vox --worker RELEASE --bundle
BUNDLE --threads T`); it speaks the protocol of `worker.py`. Only this module imports vox, always inside functions.

* The release is converted once per run into a temporary folder by vox's own converter (`python -m
  vox.build_cosyvoice --quant q8 --no-clone`, a child process: it imports torch): the LLM's linear layers in q8
  (embeddings bf16), flow and HiFT f32. `--no-clone`: the bench speaks a voice that exists already, and random-weight
  releases carry stand-in front-end graphs the converter refuses.
* The bundle's default voice (prompt text ids, prompt speech tokens, prompt mel, x-vector) is written as a `.tvoice`,
  so vox speaks the same zero-shot prompt as the device and the PyTorch reference.
* Pinned lengths: vox has no option for them; it generates between floor(text tokens x min) and floor(text tokens x
  max) speech tokens, the ratios of the `.tmod` manifest. Both are set to (N + 0.5) / text tokens of the request's
  text, so every request gets exactly N; the ratios are read when an engine opens, so the engine is reopened (untimed,
  before the peak-RSS window) when the text's token count changes.
* Sampling over the whole speech vocabulary (top_k = vocabulary, top_p = 1): under a pinned length vox redraws every
  end-of-speech token up to 100 times and fails when the release's nucleus holds nothing else, as random weights do.
  Its cost is noise beside an LLM step (tiny release, 250 tokens: the same LLM time as the release's top_k 25).
* Stream off and concurrency 1 only: vox has no token-level streaming (its audio comes per sentence group).
* Stage times are the engine's own counters (`Engine.stats()`); vox times prefill and decode together, so its whole
  LLM time is in `llm_decode`. Peak RSS as for every worker (VmHWM).
"""
from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from cosyedge.device.bench.clocks import StageClock
from cosyedge.device.bench.worker import TEXTS, WARMUP_TOKENS, Backend, Settings, serve
from cosyedge.device.errors import CosyedgeError, InputError

PEER = "vox-tts"
QUANT = "q8"
MISSING = "--peer vox needs the vox-tts package: pip install vox-tts"
# the .tmod header: magic, version major/minor, flags, reserved, manifest offset/size, data offset/size, padding
_HEADER = struct.Struct("<4sHHIIQQQQ16s")
_STAGES = {"llm_ms": "llm_decode", "flow_ms": "flow", "hift_ms": "hift"}  # Engine.stats()["backend"] -> our stage


def require_vox() -> None:
    """The one-line error that names the package when vox does not import."""
    try:
        import vox  # noqa: F401
    except ImportError:
        raise InputError(MISSING) from None


def check_peer(family: str, release: Path | None, streams: Sequence[bool], concurrency: Sequence[int]) -> None:
    """What `--peer vox` needs, checked before any worker starts."""
    require_vox()
    if family != "cosyvoice2":
        raise InputError(f"--peer vox: vox-tts converts CosyVoice2 releases only, not {family}")
    if release is None:
        raise InputError("--peer vox converts the release the bundle came from: name it with --reference MODEL_DIR")
    if False not in streams or 1 not in concurrency:
        raise InputError("--peer vox runs at stream off and concurrency 1 (vox-tts has no token-level streaming): "
                         "include them in --stream and --concurrency")


def convert(release: Path, out: Path) -> None:
    """vox's converter on the release; its refusal as one line without paths."""
    argv = [sys.executable, "-m", "vox.build_cosyvoice", "--model", str(release), "-o", str(out), "--quant", QUANT,
            "--no-clone"]
    done = subprocess.run(argv, capture_output=True, text=True, encoding="utf-8", errors="replace")
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {done.returncode}"
        for path in sorted({str(release.resolve()), str(release), str(out.parent)}, key=len, reverse=True):
            reason = reason.replace(path, release.name)
        raise CosyedgeError(f"vox-tts cannot convert release {release.name!r}: {reason[:300]}")


def edit_manifest(tmod: Path, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Rewrite a closed .tmod's manifest in place, compact, in the room before its data (the weights stay)."""
    with tmod.open("r+b") as handle:
        fields = list(_HEADER.unpack(handle.read(_HEADER.size)))
        offset, size, data = fields[5], fields[6], fields[7]
        if fields[0] != b"VOXM":
            raise CosyedgeError("vox-tts wrote no .tmod")
        handle.seek(offset)
        manifest = json.loads(handle.read(size))
        change(manifest)
        text = json.dumps(manifest, ensure_ascii=False, separators=(",", ":")).encode()
        if offset + len(text) > data:
            raise CosyedgeError("the vox-tts manifest has no room for the pinned ratios")
        fields[6] = len(text)
        handle.seek(0)
        handle.write(_HEADER.pack(*fields))
        handle.seek(offset)
        handle.write(text + bytes(data - offset - len(text)))
    return manifest


def write_voice(bundle: Path, model: dict[str, Any], path: Path) -> str:
    """The bundle's default voice as a vox `.tvoice` (vox reads a CosyVoice voice's features from the tensors
    `feat.cosy_tokens`, `feat.cosy_mel`, `feat.cosy_xvec`); returns the voice's name."""
    from vox.formats import VoiceProfile

    from cosyedge.device.bundle import Bundle
    from cosyedge.device.cosyvoice2.voices import Voice
    loaded = Bundle.load(bundle, verify=False)
    name = loaded.manifest.voices[0]
    voice = Voice.load(name, loaded.asset(f"voice:{name}"))
    tokens = np.asarray(voice.llm_prompt_speech, np.int32)
    if voice.kind != "zero_shot" or not np.array_equal(tokens, voice.flow_prompt_speech):
        raise InputError(f"--peer vox speaks the bundle's default voice, which must be zero-shot with one set of "
                         f"prompt speech tokens; {name!r} is not")
    features = {"feat.cosy_tokens": tokens, "feat.cosy_mel": np.ascontiguousarray(voice.prompt_mel, np.float32),
                "feat.cosy_xvec": voice.flow_embedding}
    # CosyVoice has no codec codes, but the writer's zero-shot ("icl") voice wants the field; extra tensors go in as
    # they are (the writer's kv_cache)
    VoiceProfile(speaker_emb=voice.flow_embedding, name=name, mode="icl", ref_text=voice.prompt_text,
                 ref_codes=np.zeros((0, 1), np.int16), ref_text_tokens=np.asarray(voice.prompt_text_ids, np.int32),
                 model=model, kv_cache=features).save(str(path))
    return name


class VoxBackend(Backend):
    """vox-tts on the converted release, one engine at a time, pinned to the token count of the current text."""

    def __init__(self, release: Path, bundle: Path, threads: int, scratch: Path) -> None:
        import vox

        self._vox, self._threads, self.clock = vox, threads, StageClock()
        self._tmod, self._voice_path, self._release = scratch / "model.tmod", scratch / "voice.tvoice", release.name
        convert(release, self._tmod)
        self._manifest = edit_manifest(self._tmod, self._full_vocabulary)
        self._voice_name = write_voice(bundle, self._manifest["model"], self._voice_path)
        self.sample_rate = int(self._manifest["audio"]["sample_rate"])
        self.samples_per_token = int(self._manifest["audio"]["samples_per_frame"]) * \
            int(self._manifest["cosyvoice"]["flow"]["token_mel_ratio"])
        llm = self._manifest["cosyvoice"]["llm"]
        self._release_ratios = (float(llm["min_token_text_ratio"]), float(llm["max_token_text_ratio"]))
        self._pinned: tuple[int, int] | None = None  # (text tokens, speech tokens) of the open engine; None: unpinned
        self._text_tokens: dict[str, int] = {}
        self._open()
        self.warm_up()

    @staticmethod
    def _full_vocabulary(manifest: dict[str, Any]) -> None:
        llm = manifest["cosyvoice"]["llm"]
        llm.update(top_k=int(llm["speech_token_size"]), top_p=1.0)

    def _open(self) -> None:
        self.engine = self._vox.Engine(str(self._tmod), "cpu", self._threads)
        self._voice = self.engine.load_voice(str(self._voice_path))

    def _count(self, text: str) -> int:
        """Text tokens of the one piece vox speaks `text` as (the ratios apply per piece)."""
        if text not in self._text_tokens:
            pieces = self.engine.phonemize(text)["tokens"]
            if len(pieces) != 1:
                raise InputError(f"vox-tts speaks this bench text as {len(pieces)} pieces; the bench pins one")
            self._text_tokens[text] = len(pieces[0])
        return self._text_tokens[text]

    def prepare(self, texts: Sequence[str], settings: Settings) -> bool:
        """Reopen the engine pinned to this batch's text and token count when the open one is pinned otherwise."""
        if len(set(texts)) != 1:
            raise InputError("--peer vox runs one text per batch (concurrency 1)")
        pin = None if settings.tokens is None else (self._count(texts[0]), settings.tokens)
        if pin == self._pinned:
            return False
        del self._voice
        self.engine.close()
        ratio = self._release_ratios if pin is None else ((pin[1] + 0.5) / pin[0],) * 2
        edit_manifest(self._tmod, lambda manifest: manifest["cosyvoice"]["llm"].update(
            min_token_text_ratio=ratio[0], max_token_text_ratio=ratio[1]))
        self._pinned = pin
        self._open()
        return True

    def warm_up(self) -> None:
        settings = Settings(WARMUP_TOKENS, "greedy")
        self.prepare([TEXTS[1]], settings)
        for _ in self.synthesize(TEXTS[1], False, settings, 0)[1]:
            pass

    def describe(self) -> dict[str, Any]:
        precision = self._manifest["precision"]
        llm = precision["quant"] if precision["quant"] != "none" else precision["weights"]
        flow = {"f32": "fp32"}.get(precision["flow"], precision["flow"])
        return {"backend": PEER, "bundle": self._release, "sample_rate": self.sample_rate,
                "precision": {"llm": llm, "flow_encoder": flow, "flow_estimator": flow, "hift_source": flow,
                              "hift_decoder": flow},
                "peer": {"name": PEER, "version": str(self._vox.__version__), "quant": QUANT,
                         "converter": f"python -m vox.build_cosyvoice --quant {QUANT} --no-clone",
                         "llm": f"linear layers {llm}, embeddings {precision['weights']}", "flow_hift": flow,
                         "voice": self._voice_name, "streaming": "off only: vox-tts has no token-level streaming",
                         "sampler": "whole speech vocabulary (top_k = vocabulary, top_p 1.0)",
                         "llm_decode": "vox-tts times its LLM prefill and decode together: both are in llm_decode"}}

    def synthesize(self, text: str, stream: bool, settings: Settings, index: int) -> tuple[int, Iterator[np.ndarray]]:
        if stream:
            raise InputError("vox-tts has no token-level streaming")
        return 1, self._chunks(text, settings.seed + index)

    def _chunks(self, text: str, seed: int) -> Iterator[np.ndarray]:
        before = self.engine.stats()["backend"]
        yield from self.engine.stream(text, self._voice, seed=seed)
        after = self.engine.stats()["backend"]
        for counter, stage in _STAGES.items():
            self.clock.add(stage, (after[counter] - before[counter]) / 1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyedge.device.bench.peer_vox",
                                     description="vox-tts bench worker (internal to cosyedge bench --peer vox)")
    parser.add_argument("--worker", required=True, metavar="RELEASE_DIR")
    parser.add_argument("--bundle", required=True, help="the bundle whose default voice vox speaks")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cosyedge-bench-vox-") as scratch:
        return serve(lambda: VoxBackend(Path(args.worker), Path(args.bundle), args.threads, Path(scratch)))


if __name__ == "__main__":
    sys.exit(main())
