"""Prompt-audio features of CosyVoice2 in numpy: resampling, Kaldi fbank, Whisper log-mel, the flow's mel.

The official frontend computes these with torchaudio / whisper / Matcha in torch; the device has no torch, so
each transform is written here from its definition and checked against the official outputs. Spectra are computed
in float64 and returned as float32 (the official float32 results differ from exact ones by less than the test
tolerances).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import onnxruntime as ort

from cosyedge.device.errors import InputError
from cosyedge.device.voice_store import MAX_PROMPT_RATE, MIN_PROMPT_RATE

SPEAKER_SAMPLE_RATE = 16000      # CAM++ and the speech tokenizer both take 16 kHz audio
MAX_PROMPT_SECONDS = 30.0        # the speech tokenizer's limit (an assertion in the official frontend)
MIN_PROMPT_SECONDS = 0.1         # below this the official code fails (empty fbank, impossible reflect padding)
TOKEN_MEL_RATIO = 2              # 25 Hz speech tokens, 50 Hz mel frames

WHISPER_N_FFT = 400
WHISPER_HOP = 160
WHISPER_N_MELS = 128

FBANK_N_MELS = 80


@dataclass(frozen=True)
class FlowMelConfig:
    """The yaml `feat_extractor` arguments (Matcha `mel_spectrogram`): the flow's prompt-mel definition."""
    n_fft: int
    hop: int
    win: int
    n_mels: int
    fmin: float
    fmax: float | None
    sample_rate: int


@dataclass(frozen=True)
class PromptFeatures:
    """What a prompt voice gives the LLM and the flow, already aligned (mel frames = TOKEN_MEL_RATIO x tokens).

    tokens: (n_tokens,) int64 speech tokens; mel: (2 n_tokens, n_mels) float32 flow prompt mel;
    embedding: (192,) float32 CAM++ speaker embedding.
    """
    tokens: np.ndarray
    mel: np.ndarray
    embedding: np.ndarray


# ---------------------------------------------------------------------------------------------------- resampling

@lru_cache(maxsize=16)
def _sinc_kernel(orig: int, new: int, lowpass_filter_width: int, rolloff: float) -> tuple[np.ndarray, int]:
    """Polyphase windowed-sinc kernel (new, 2 width + orig) for orig -> new (both divided by their gcd).

    Hann-windowed sinc with cutoff rolloff x min(orig, new) / 2, `lowpass_filter_width` zero crossings each side,
    rounded to float32 like torchaudio's default kernel.
    """
    base_freq = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    idx = np.arange(-width, width + orig, dtype=np.float64)[None, :] / orig
    # torchaudio forms the per-phase offsets -k/new in float32 before adding the float64 positions
    phase = (np.arange(0, -new, -1, dtype=np.float64) / new).astype(np.float32).astype(np.float64)[:, None]
    t = np.clip((phase + idx) * base_freq, -lowpass_filter_width, lowpass_filter_width)
    window = np.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    with np.errstate(invalid="ignore", divide="ignore"):
        sinc = np.where(t == 0, 1.0, np.sin(t) / t)
    kernel = sinc * window * (base_freq / orig)
    return kernel.astype(np.float32), width


# An exact polyphase kernel has `new x (2 width + orig)` taps: small for the usual rates (44.1 -> 16 kHz: 76 k),
# but an odd rate such as 47999 Hz (gcd 1 with 16000) would need gigabytes. Above this many taps the same
# windowed sinc is evaluated directly per output sample instead, in blocks: memory and time stay linear.
MAX_POLYPHASE_TAPS = 1 << 22
_DIRECT_BLOCK = 4096  # output samples per block of the direct path


def resample(wav: np.ndarray, sr_in: int, sr_out: int, lowpass_filter_width: int = 6,
             rolloff: float = 0.99) -> np.ndarray:
    """Band-limited resampling of a 1-D waveform, equal to torchaudio `Resample` with its defaults (sinc_interp_hann).

    Any pair of integer rates works in bounded memory: rare rate pairs take the direct path (same filter).
    """
    wav = np.asarray(wav, dtype=np.float32)
    if wav.ndim != 1:
        raise InputError("resample expects a mono (1-D) waveform")
    if sr_in == sr_out:
        return wav.copy()
    gcd = math.gcd(int(sr_in), int(sr_out))
    orig, new = int(sr_in) // gcd, int(sr_out) // gcd
    width = math.ceil(lowpass_filter_width * orig / (min(orig, new) * rolloff))
    target_length = math.ceil(new * wav.shape[0] / orig)
    if new * (2 * width + orig) > MAX_POLYPHASE_TAPS:
        return _resample_direct(wav, orig, new, lowpass_filter_width, rolloff, target_length)
    kernel, width = _sinc_kernel(orig, new, lowpass_filter_width, rolloff)
    padded = np.pad(wav.astype(np.float64), (width, width + orig))
    frames = np.lib.stride_tricks.sliding_window_view(padded, kernel.shape[1])[::orig]
    out = (frames @ kernel.astype(np.float64).T).reshape(-1)
    return out[:target_length].astype(np.float32)


def _resample_direct(wav: np.ndarray, orig: int, new: int, lowpass_filter_width: int, rolloff: float,
                     target_length: int) -> np.ndarray:
    """The polyphase filter evaluated per output sample m: weight of input p is f((p / orig - m / new) x base).

    Only the inputs within the filter's support (|t| < width zero crossings) are visited, so each output costs
    about 2 x width taps whatever the rates' ratio.
    """
    base_freq = min(orig, new) * rolloff
    reach = lowpass_filter_width * orig / base_freq  # input samples on each side of an output's centre
    taps = np.arange(-math.ceil(reach) - 1, math.ceil(reach) + 2)
    source = wav.astype(np.float64)
    out = np.empty(target_length, dtype=np.float64)
    for start in range(0, target_length, _DIRECT_BLOCK):
        m = np.arange(start, min(start + _DIRECT_BLOCK, target_length))
        centre = (m * orig) // new
        p = centre[:, None] + taps[None, :]
        t = np.clip((p / orig - m[:, None] / new) * base_freq, -lowpass_filter_width, lowpass_filter_width)
        window = np.cos(t * math.pi / lowpass_filter_width / 2) ** 2
        t = t * math.pi
        with np.errstate(invalid="ignore", divide="ignore"):
            sinc = np.where(t == 0, 1.0, np.sin(t) / t)
        valid = (p >= 0) & (p < source.size)
        samples = np.where(valid, source[np.clip(p, 0, source.size - 1)], 0.0)
        out[m] = np.sum(samples * sinc * window, axis=1) * (base_freq / orig)
    return out.astype(np.float32)


# ---------------------------------------------------------------------------------------------------- Kaldi fbank

def _kaldi_mel(freq: np.ndarray) -> np.ndarray:
    return 1127.0 * np.log1p(freq / 700.0)


@lru_cache(maxsize=8)
def _kaldi_mel_banks(n_mels: int, padded_window: int, sample_rate: int, low_freq: float,
                     high_freq: float) -> np.ndarray:
    """Kaldi's triangular filters on the mel scale 1127 ln(1 + f/700): (n_mels, padded_window // 2 + 1).

    Triangles are drawn in mel space (not Slaney-normalised); the Nyquist bin gets weight 0 as in Kaldi.
    """
    n_bins = padded_window // 2
    mel_low, mel_high = _kaldi_mel(np.float64(low_freq)), _kaldi_mel(np.float64(high_freq))
    delta = (mel_high - mel_low) / (n_mels + 1)
    index = np.arange(n_mels, dtype=np.float64)[:, None]
    left, center, right = mel_low + index * delta, mel_low + (index + 1) * delta, mel_low + (index + 2) * delta
    mel = _kaldi_mel(np.arange(n_bins, dtype=np.float64) * (sample_rate / padded_window))[None, :]
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = np.maximum(0.0, np.minimum(up, down))
    return np.pad(banks, ((0, 0), (0, 1)))


def kaldi_fbank(wav_16k: np.ndarray, n_mels: int = FBANK_N_MELS, sample_rate: int = SPEAKER_SAMPLE_RATE) -> np.ndarray:
    """Kaldi log mel filterbank (frames, n_mels): 25 ms Povey windows every 10 ms, snip_edges, no dither.

    Per frame: remove the DC offset, pre-emphasis 0.97, Povey window, zero-pad to a power of two, power spectrum,
    mel filters from 20 Hz to Nyquist, ln with float32-epsilon floor. The waveform is used at [-1, 1] scale.
    """
    wav = np.asarray(wav_16k, dtype=np.float64).reshape(-1)
    frame_length = int(sample_rate * 0.025)
    frame_shift = int(sample_rate * 0.010)
    padded_window = 1 << (frame_length - 1).bit_length()
    if wav.shape[0] < frame_length:
        return np.zeros((0, n_mels), dtype=np.float32)
    n_frames = 1 + (wav.shape[0] - frame_length) // frame_shift
    frames = np.lib.stride_tricks.sliding_window_view(wav, frame_length)[::frame_shift][:n_frames]
    frames = frames - frames.mean(axis=1, keepdims=True)
    previous = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    frames = frames - 0.97 * previous
    povey = (0.5 - 0.5 * np.cos(2 * math.pi * np.arange(frame_length) / (frame_length - 1))) ** 0.85
    power = np.abs(np.fft.rfft(frames * povey, n=padded_window, axis=1)) ** 2
    banks = _kaldi_mel_banks(n_mels, padded_window, sample_rate, 20.0, sample_rate / 2)
    energies = power @ banks.T
    return np.log(np.maximum(energies, np.finfo(np.float32).eps)).astype(np.float32)


def mean_normalize(fbank: np.ndarray) -> np.ndarray:
    """Subtract each bin's mean over time: the CAM++ input (removes channel and level offsets)."""
    return (fbank - fbank.mean(axis=0, keepdims=True)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------- mel filters

def _hz_to_slaney_mel(freq: np.ndarray) -> np.ndarray:
    freq = np.asarray(freq, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    linear = freq / f_sp
    return np.where(freq >= min_log_hz, min_log_mel + np.log(np.maximum(freq, 1e-10) / min_log_hz) / logstep, linear)


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(mel >= min_log_mel, min_log_hz * np.exp(logstep * (mel - min_log_mel)), f_sp * mel)


@lru_cache(maxsize=8)
def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                       fmax: float | None = None) -> np.ndarray:
    """librosa's default mel filterbank (Slaney mel scale, Slaney area normalisation): (n_mels, n_fft // 2 + 1).

    Triangles are drawn in Hz between mel-spaced edges, each scaled by 2 / (its width in Hz). Float32, read-only.
    """
    fmax = sample_rate / 2 if fmax is None else fmax
    fft_freqs = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate)
    edges = _slaney_mel_to_hz(np.linspace(_hz_to_slaney_mel(fmin), _hz_to_slaney_mel(fmax), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper)).astype(np.float32)  # librosa stores float32, then scales
    weights = (weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]).astype(np.float32)
    weights.setflags(write=False)
    return weights


def whisper_mel_filters(n_mels: int = WHISPER_N_MELS) -> np.ndarray:
    """Whisper's stored filterbank: librosa Slaney filters for 16 kHz, n_fft 400."""
    return slaney_mel_filters(SPEAKER_SAMPLE_RATE, WHISPER_N_FFT, n_mels)


# ---------------------------------------------------------------------------------------------------- spectrograms

def _stft_magnitude(wav: np.ndarray, n_fft: int, hop: int, win: int) -> np.ndarray:
    """|STFT| (n_fft // 2 + 1, frames) of an already padded signal, periodic Hann window centred in n_fft, no centring."""
    window = 0.5 - 0.5 * np.cos(2 * math.pi * np.arange(win) / win)
    left = (n_fft - win) // 2
    window = np.pad(window, (left, n_fft - win - left))
    n_frames = 1 + (wav.shape[0] - n_fft) // hop
    frames = np.lib.stride_tricks.sliding_window_view(wav, n_fft)[::hop][:n_frames]
    return np.fft.rfft(frames * window, axis=1).T


def whisper_log_mel(wav_16k: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """Whisper log-mel (n_mels, frames): centred STFT (reflect), last frame dropped, log10 power, 8-decade floor.

    No padding to 30 s: the frame count is len / 160, as in the official speech-tokenizer call.
    """
    wav = np.asarray(wav_16k, dtype=np.float64).reshape(-1)
    half = WHISPER_N_FFT // 2
    if wav.shape[0] <= half:
        raise InputError("prompt audio is too short")
    spectrum = _stft_magnitude(np.pad(wav, (half, half), mode="reflect"), WHISPER_N_FFT, WHISPER_HOP, WHISPER_N_FFT)
    power = np.abs(spectrum[:, :-1]) ** 2
    log_spec = np.log10(np.maximum(filters.astype(np.float64) @ power, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def flow_mel(wav_24k: np.ndarray, n_fft: int, hop: int, win: int, n_mels: int, fmin: float, fmax: float | None,
             sr: int) -> np.ndarray:
    """The flow's mel (frames, n_mels) as Matcha computes it: reflect pad (n_fft - hop) / 2, periodic Hann STFT
    without centring, sqrt(|X|^2 + 1e-9), Slaney mel filters, ln with a 1e-5 floor. Frames = len // hop."""
    wav = np.asarray(wav_24k, dtype=np.float64).reshape(-1)
    pad = (n_fft - hop) // 2
    if wav.shape[0] <= pad:
        raise InputError("prompt audio is too short")
    spectrum = _stft_magnitude(np.pad(wav, (pad, pad), mode="reflect"), n_fft, hop, win)
    magnitude = np.sqrt(spectrum.real ** 2 + spectrum.imag ** 2 + 1e-9)
    mel = slaney_mel_filters(sr, n_fft, n_mels, fmin, fmax).astype(np.float64) @ magnitude
    return np.log(np.maximum(mel, 1e-5)).T.astype(np.float32)


# ---------------------------------------------------------------------------------------------------- prompt

def align_prompt(tokens: np.ndarray, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cut tokens and mel to a common length: token_len = min(frames // 2, n_tokens), mel frames = 2 token_len."""
    token_len = min(mel.shape[0] // TOKEN_MEL_RATIO, tokens.shape[0])
    return tokens[:token_len], mel[:TOKEN_MEL_RATIO * token_len]


def _to_mono(wav: np.ndarray) -> np.ndarray:
    """Mean over channels; accepts (samples,) or soundfile's (samples, channels)."""
    wav = np.asarray(wav, dtype=np.float32)
    if wav.ndim == 2:
        wav = wav.mean(axis=1, dtype=np.float32)
    if wav.ndim != 1:
        raise InputError("prompt audio must be mono or (samples, channels)")
    return wav


def extract_prompt(wav: np.ndarray, sr: int, campplus_session: ort.InferenceSession,
                   tokenizer_session: ort.InferenceSession, mel_config: FlowMelConfig) -> PromptFeatures:
    """Speech tokens, flow mel and CAM++ embedding of a prompt recording, as the official zero-shot frontend makes them.

    `wav` is float audio in [-1, 1] at `sr` Hz; the ONNX sessions are the release's campplus.onnx and
    speech_tokenizer_v2.onnx.
    """
    wav = _to_mono(wav)
    if not MIN_PROMPT_RATE <= sr <= MAX_PROMPT_RATE:  # lower rates are upsampled; the resampler takes any pair
        raise InputError(f"prompt audio must be sampled at {MIN_PROMPT_RATE}-{MAX_PROMPT_RATE} Hz, got {sr} Hz")
    seconds = wav.shape[0] / sr
    if seconds > MAX_PROMPT_SECONDS:
        raise InputError(f"prompt audio is {seconds:.1f} s long; at most {MAX_PROMPT_SECONDS:.0f} s is supported")
    if seconds < MIN_PROMPT_SECONDS:
        raise InputError(f"prompt audio is {seconds * 1000:.0f} ms long; at least "
                         f"{MIN_PROMPT_SECONDS * 1000:.0f} ms is needed")
    if not np.all(np.isfinite(wav)):
        raise InputError("prompt audio contains NaN or infinite samples")

    wav_16k = resample(wav, sr, SPEAKER_SAMPLE_RATE)
    fbank = mean_normalize(kaldi_fbank(wav_16k))
    embedding = campplus_session.run(None, {campplus_session.get_inputs()[0].name: fbank[None]})[0]

    log_mel = whisper_log_mel(wav_16k, whisper_mel_filters())
    names = [i.name for i in tokenizer_session.get_inputs()]
    tokens = tokenizer_session.run(None, {names[0]: log_mel[None],
                                          names[1]: np.array([log_mel.shape[1]], dtype=np.int32)})[0]

    c = mel_config
    mel = flow_mel(resample(wav, sr, c.sample_rate), c.n_fft, c.hop, c.win, c.n_mels, c.fmin, c.fmax, c.sample_rate)
    tokens, mel = align_prompt(np.asarray(tokens).reshape(-1).astype(np.int64), mel)
    return PromptFeatures(tokens=tokens, mel=mel, embedding=np.asarray(embedding, dtype=np.float32).reshape(-1))
