"""Rows of a large `.npy` table read on demand, without mapping it (the LLM's text-embedding table, 544 MB at
CosyVoice2-0.5B size, and its speech-token table, 23.5 MB: a decode step reads one row per request, and held whole
the table was a service's resident memory).

Why not `np.load(mmap_mode="r")`: reading a row through a mapping maps the page-cache folio around it, and where the
kernel caches files in large folios (ext4 on Linux 6.x) a folio is up to 2 MB. On the full-size table (ext4, Linux
6.18), 20 random rows added 41 MB to the process's resident set, 200 rows 269 MB and 2000 rows 510 MB, with
`madvise` RANDOM and NOHUGEPAGE alike: a service reading varied text ends with most of the table resident. `pread`
copies only the rows asked for (3.5 KB each) and maps nothing; the file's pages stay in the page cache, which the
kernel reclaims as it needs.
"""
from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np


class TableRows:
    """A 2-D C-order `.npy` table whose rows are read with `pread` (thread-safe: no shared file position)."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran_order, dtype = header(handle)
            self._offset = handle.tell()
        if len(shape) != 2 or fortran_order or dtype.hasobject:
            raise ValueError(f"{Path(path).name}: a 2-D C-order numeric table is needed, not {shape} {dtype}")
        self.shape: tuple[int, int] = (int(shape[0]), int(shape[1]))
        self.dtype = dtype
        self._row_bytes = self.shape[1] * dtype.itemsize
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    def rows(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """[len(ids), width] copies of the rows `ids` (each in 0..rows-1; IndexError otherwise)."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise IndexError(f"row ids must be in 0..{self.shape[0] - 1}")
        out = np.empty((ids.size, self.shape[1]), self.dtype)
        for index, row in enumerate(ids.tolist()):
            data = os.pread(self._fd, self._row_bytes, self._offset + row * self._row_bytes)
            if len(data) != self._row_bytes:
                raise IndexError(f"row {row} is past the end of the table file")
            out[index] = np.frombuffer(data, self.dtype)
        return out
