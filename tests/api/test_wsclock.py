"""The WebSocket session's clock (api/routes/wsclock.py): a word waits for the output samples that hold its end,
on the output rate's clock, and the words left when a sentence ends all go before its segment event."""
from __future__ import annotations

from cosyedge.api.routes.wsclock import SessionClock
from cosyedge.device.options import Word


def test_words_wait_for_their_output_samples_at_the_output_rate():
    clock = SessionClock()
    clock.start(22050, 16000)
    clock.samples = 22050  # the sentence starts 1 s into the session
    clock.hold([Word("one", 0.0, 0.25), Word("two", 0.3, 0.5)], start=22050)
    assert clock.sent_out(16000 + 3999) == []  # 1.25 s is output sample 20000
    assert [e["text"] for e in clock.sent_out(1)] == ["one"]
    assert clock.sent_out(3999) == []  # 1.5 s is 24000: the resampler still holds its last sample
    assert clock.rest() == [{"type": "word", "text": "two", "start_s": 1.3, "end_s": 1.5}]
    assert clock.rest() == [] and clock.seconds(clock.samples) == 1.0


def test_times_are_rounded_to_the_output_rate_samples():
    clock = SessionClock()
    clock.start(24000, 8000)
    clock.hold([Word("a", 0.0, 0.00019)], start=0)  # 1.52 samples at 8 kHz: 2
    assert clock.sent_out(1) == []
    assert clock.sent_out(1) == [{"type": "word", "text": "a", "start_s": 0.0, "end_s": 0.00025}]
