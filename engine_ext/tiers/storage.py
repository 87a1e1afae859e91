"""Where a lower tier keeps its blocks: host memory or a memory-mapped file.

Both are one tensor of shape (num_blocks, num_layers, 2, block_size, kv_heads, head_dim):
block-major, so one block is one contiguous run of bytes (one read on disk). Host
memory stands for the pinned CPU memory a GPU server would use. The disk file is
unlinked as soon as it is mapped, so it disappears with the process. After a block is
written its pages are synced and dropped from memory (this mapping and the page cache),
and after it is read they are dropped again: every read is a real disk read, which is
what a disk tier's timing must show.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import torch

from engine_ext.errors import ModelLoadError


class HostStorage:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.blocks = torch.empty(shape, dtype=dtype)  # (N, L, 2, bs, H, D)

    def settle(self, slots: list[int]) -> None:
        """Nothing to do: host memory is where the data lives."""

    def forget(self, slots: list[int]) -> None:
        """Nothing to do: host memory is where the data lives."""

    def close(self) -> None:
        """Nothing to release before the tensor itself goes."""


class DiskStorage:
    def __init__(self, directory: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        num_bytes = dtype.itemsize
        for size in shape:
            num_bytes *= size
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="kvrelay-kv-", suffix=".bin", dir=directory)
        except OSError as exc:
            raise ModelLoadError(f"cannot create the disk KV tier in {directory}: {exc}") from exc
        try:
            os.unlink(path)
            os.ftruncate(fd, num_bytes)
            self._map = mmap.mmap(fd, num_bytes)
        except OSError as exc:
            os.close(fd)
            raise ModelLoadError(f"cannot map {num_bytes} bytes for the disk KV tier in {directory}: {exc}") from exc
        self._fd = fd
        self.block_bytes = num_bytes // shape[0]
        self.blocks = torch.frombuffer(self._map, dtype=dtype).view(shape)  # (N, L, 2, bs, H, D)

    def settle(self, slots: list[int]) -> None:
        """Write the slots' pages to the file and drop them from memory."""
        for start, size in self._pages(slots):
            self._map.flush(start, size)
        self.forget(slots)

    def forget(self, slots: list[int]) -> None:
        """Drop the slots' (clean) pages from this mapping and from the page cache, so
        the next read of them is a disk read again."""
        for start, size in self._pages(slots):
            self._map.madvise(mmap.MADV_DONTNEED, start, size)
            os.posix_fadvise(self._fd, start, size, os.POSIX_FADV_DONTNEED)

    def _pages(self, slots: list[int]) -> list[tuple[int, int]]:
        """Each slot's byte range, widened to whole pages: (start, size)."""
        page = mmap.PAGESIZE
        out = []
        for slot in slots:
            start = slot * self.block_bytes // page * page
            end = min(-(-(slot + 1) * self.block_bytes // page) * page, len(self._map))
            out.append((start, end - start))
        return out

    def close(self) -> None:
        """Close the file; the mapping goes with the last tensor that views it."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
