"""Speaker similarity of the build host: Resemblyzer's pretrained encoder needs torch, so it lives here.

The numpy metrics (mel-cepstral distortion, SNR) are the device's: `cosyedge.device.quality`.
"""
from __future__ import annotations

import numpy as np


class SpeakerSimilarity:
    """Cosine similarity of Resemblyzer speaker embeddings; `available` is False without the build-host extra."""

    def __init__(self) -> None:
        try:
            from resemblyzer import VoiceEncoder, preprocess_wav
        except Exception as exc:  # noqa: BLE001 - torch or webrtcvad missing: report why
            self.available, self.reason = False, f"resemblyzer unavailable ({type(exc).__name__}); install the [quantize] extra"
            return
        self.available, self.reason = True, ""
        self._encoder = VoiceEncoder(device="cpu", verbose=False)
        self._preprocess = preprocess_wav

    def __call__(self, reference: np.ndarray, test: np.ndarray, sample_rate: int) -> float:
        a = self._encoder.embed_utterance(self._preprocess(reference, source_sr=sample_rate))
        b = self._encoder.embed_utterance(self._preprocess(test, source_sr=sample_rate))
        return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
