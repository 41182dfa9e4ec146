"""CosyVoice2's parts of the shared CosyVoice pipeline (`parts.FamilyParts`), and the family's pipeline factory.

Text: the official CosyVoice2 frontend (`frontend.TextFrontend`: an instruction gets `<|endofprompt|>` appended,
any LLM prompt is taken). Decoding: the manifest's eos and stop ids. Vocoder: HiFT with the NSF noise drawn from the
request's generator and the official streaming caches and cross-fade (`vocoder.py`). Every LLM token is voiced.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.frontend import TextFrontend
from cosyedge.device.cosyvoice2.llm import DecodeConfig
from cosyedge.device.cosyvoice2.parts import FamilyParts
from cosyedge.device.cosyvoice2.pipeline import CosyVoicePipeline
from cosyedge.device.cosyvoice2.streaming import KeepAll, ScheduleConfig
from cosyedge.device.cosyvoice2.vocoder import HiftCache, Vocoder
from cosyedge.device.cosyvoice2.voices import MODES
from cosyedge.device.sessions import SessionConfig


def vocoder(config: dict[str, Any], hift: tuple[Any, Any], sample_rate: int) -> Vocoder:
    """The HiFT part from the manifest config and the (`hift_source`, `hift_decoder`) sessions."""
    return Vocoder(hift[0], hift[1], int(config["hift_upsample"]), HiftCache.from_config(config["stream"]))


def parts(config: dict[str, Any], tokenizer: Path, hift: tuple[Any, Any], sample_rate: int) -> FamilyParts:
    return FamilyParts(family="cosyvoice2", frontend=TextFrontend(tokenizer), decode=DecodeConfig.from_config(config),
                       vocoder=vocoder(config, hift, sample_rate), schedule=ScheduleConfig.from_config(config["stream"]),
                       token_filter=KeepAll, modes=MODES, languages=("zh", "en", "ja", "ko", "yue"),
                       attribution=("FunAudioLLM CosyVoice2", "https://github.com/FunAudioLLM/CosyVoice"))


def pipeline(bundle: Bundle, selection: str, sessions: SessionConfig) -> CosyVoicePipeline:
    """A `cosyvoice2` bundle's pipeline (families.py)."""
    return CosyVoicePipeline(bundle, selection, sessions, parts)
