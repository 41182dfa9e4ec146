"""Answers with word times (`timestamps`, `subtitles` on POST /v1/tts and /v1/audio/speech): the door's chunks of a
words job (`Job(words=True)`) become a JSON body with the encoded audio, its words and its segments, or a subtitle
file alone. Times are in seconds on the delivered audio's clock (rounded to its samples at `X-Sample-Rate`)."""
from __future__ import annotations

import base64
import json
from typing import Sequence

from cosyedge.api.bodies import Speech
from cosyedge.device.door import Chunk
from cosyedge.device.options import Word, on_rate
from cosyedge.device.subtitles import join_words, write

NDJSON = "application/x-ndjson"  # a streamed `timestamps` answer (`streaming.audio_body(timed=True)`)
SUBTITLE_TYPES = {"vtt": "text/vtt; charset=utf-8", "srt": "application/x-subrip; charset=utf-8"}


def timed_answer(job: Speech, chunks: Sequence[Chunk], audio: bytes | None, rate: int, out_rate: int,
                 ) -> tuple[bytes, str]:
    """The body and Content-Type of a words job's answer; `rate` is the engine's, `out_rate` the delivered one."""
    duration_s = sum(chunk.audio.size for chunk in chunks) / rate
    words = on_rate([word for chunk in chunks for word in chunk.words], out_rate)
    if job.subtitles:
        return write(words, duration_s, job.subtitles).encode(), SUBTITLE_TYPES[job.subtitles]
    bounds, heard = [], 0
    for index, segment in enumerate(job.segments):
        start = heard
        heard += sum(chunk.audio.size for chunk in chunks if chunk.segment == index)
        bounds.append(Word(join_words([text for text, _, _ in segment.words]), start / rate, heard / rate))
    body = {"format": job.format, "sample_rate": out_rate, "audio_seconds": round(duration_s, 6),
            "audio": base64.b64encode(audio or b"").decode(), "words": [_timed(w) for w in words],
            "segments": [_timed(s) for s in on_rate(bounds, out_rate)]}
    return json.dumps(body, ensure_ascii=False).encode(), "application/json"


def _timed(word: Word) -> dict:
    return {"text": word.text, "start_s": word.start_s, "end_s": word.end_s}
