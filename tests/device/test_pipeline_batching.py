"""The base pipeline's padded batches are bounded by token ids, not only by rows (issue 10: 64 clients grew the
default voice's service to 2.1 GB through padded batches of 8)."""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from cosyedge.device.options import Segment, SynthesisOptions
from cosyedge.device.pipeline import Pipeline


class Recording(Pipeline):
    """A family whose model call only records the shape it was given (rows, longest row)."""

    sample_rate = 16000

    def __init__(self, batch_ids_max: int) -> None:
        self.batch_ids_max = batch_ids_max
        self.calls: list[tuple[int, int]] = []

    def voices(self) -> list[str]:
        return ["a"]

    def segments(self, text: str) -> list[Segment]:
        return [Segment(text, tuple(range(len(text))))]

    def synthesize(self, segments: Sequence[Segment], options: SynthesisOptions) -> list[np.ndarray]:
        self.calls.append((len(segments), max(len(s.ids) for s in segments)))
        return [np.full(len(s.ids), len(s.ids), np.float32) for s in segments]

    def stream(self, segment: Segment, options: SynthesisOptions) -> Iterator[np.ndarray]:
        yield from self.synthesize([segment], options)

    def describe(self) -> dict[str, Any]:
        return {}


def _jobs(lengths: list[int]) -> list[tuple[list[Segment], SynthesisOptions]]:
    options = SynthesisOptions(voice="a")
    return [([Segment("x" * n, tuple(range(n)))], options) for n in lengths]


def test_batches_never_pass_the_padded_id_bound_and_keep_job_order():
    lengths = [300, 20, 900, 40, 60, 500, 10, 700]
    pipeline = Recording(batch_ids_max=1000)
    waves = pipeline.synthesize_many(_jobs(lengths), batch_max=8)
    assert [int(w[0][0]) for w in waves] == lengths  # every job got its own segment back, in order
    assert all(rows * longest <= 1000 or rows == 1 for rows, longest in pipeline.calls), pipeline.calls
    assert sum(rows for rows, _ in pipeline.calls) == len(lengths)
    assert max(rows for rows, _ in pipeline.calls) > 1  # short segments still share calls


def test_zero_means_one_segment_per_call():
    pipeline = Recording(batch_ids_max=0)
    pipeline.synthesize_many(_jobs([5, 6, 7]), batch_max=8)
    assert pipeline.calls == [(1, 5), (1, 6), (1, 7)]


def test_rows_are_still_bounded_by_batch_max():
    pipeline = Recording(batch_ids_max=10**9)
    pipeline.synthesize_many(_jobs([5] * 10), batch_max=4)
    assert [rows for rows, _ in pipeline.calls] == [4, 4, 2]
