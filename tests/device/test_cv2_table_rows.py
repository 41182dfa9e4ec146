"""The LLM's text-embedding table is read row by row with pread, never mapped (device/cosyvoice2/table_rows.py: a
mapping kept up to 2 MB resident per row read on kernels with large folios, most of the 544 MB table in a service
reading varied text): the rows equal numpy's, ids out of range are refused, and an engine that has synthesized with
word times has no mapping of the table file, nor of the speech-token table (read the same way, by the decode steps
and the word-timing pass), and holds no copy of either."""
from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.table_rows import TableRows
from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig


def test_rows_equal_numpys_and_out_of_range_ids_are_refused(cv2_tiny_bundle: Path, tmp_path: Path):
    path = Bundle.load(cv2_tiny_bundle).asset("embed_tokens")
    table, whole = TableRows(path), np.load(path)
    assert table.shape == whole.shape and table.dtype == whole.dtype
    ids = np.array([0, whole.shape[0] - 1, *np.random.default_rng(0).integers(0, whole.shape[0], 50), 7, 7])
    np.testing.assert_array_equal(table.rows(ids), whole[ids])
    assert table.rows([]).shape == (0, whole.shape[1])
    for wrong in ([-1], [whole.shape[0]]):
        with pytest.raises(IndexError):
            table.rows(wrong)
    np.save(tmp_path / "cube.npy", np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        TableRows(tmp_path / "cube.npy")


def test_a_synthesizing_engine_maps_nothing_of_the_tables_and_holds_neither(cv2_tiny_bundle: Path):
    tracemalloc.start(16)  # numpy reports its buffers to tracemalloc: a table loaded whole is a live block
    try:
        engine = Engine.load(cv2_tiny_bundle, precision="fp32", warmup=False,
                             sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))
        wave, words = engine.synthesize_words("收到好友从远方寄来的生日礼物。", voice="tiny_spk_zh", deterministic=True)
        in_lm = [tracemalloc.Filter(True, f"*/cosyvoice2/{name}.py", all_frames=True) for name in ("llm", "attention")]
        held = tracemalloc.take_snapshot().filter_traces(in_lm).statistics("traceback")
    finally:
        tracemalloc.stop()
    assert wave.size and words
    tables = [engine.bundle.asset(name).resolve() for name in ("embed_tokens", "speech_embedding")]
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines()
              if line.endswith(tuple(str(table) for table in tables))]
    assert mapped == []
    smallest = min(np.load(table, mmap_mode="r").nbytes for table in tables)
    assert smallest > 100_000  # the tiny tables are large enough to stand out
    assert [stat for stat in held if stat.size >= smallest] == []
