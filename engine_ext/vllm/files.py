"""BlockFiles: one tier's directory, one file per block (named by its chained hash).

A block file holds the block of every layer, raw, in the layout vLLM's cache uses; its
size is checked on every read, so a file from another model or a cut-off write is never
taken for KV. Writes go to a temporary name and are renamed into place, so a reader sees
a whole file or none.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch


class BlockFileError(Exception):
    """A block file is missing, unreadable or of the wrong size."""


class BlockFiles:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, block_hash: bytes) -> Path:
        return self.directory / block_hash.hex()

    def hashes(self) -> list[bytes]:
        """The blocks in the directory, oldest first (by modification time)."""
        found = []
        for entry in os.scandir(self.directory):
            if entry.is_file() and not entry.name.startswith("."):
                try:
                    found.append((entry.stat().st_mtime, bytes.fromhex(entry.name)))
                except ValueError:
                    continue  # not a block file: leave it alone
        return [block_hash for _, block_hash in sorted(found)]

    def clear_partial(self) -> None:
        """Remove the temporary files of writes a crash cut short."""
        for path in self.directory.glob(".part-*"):
            path.unlink(missing_ok=True)

    def write(self, block_hash: bytes, data: torch.Tensor) -> None:
        """Write a contiguous CPU tensor as the block's file."""
        fd, tmp = tempfile.mkstemp(prefix=".part-", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as out:
                data.view(torch.uint8).numpy().tofile(out)
            os.replace(tmp, self.path(block_hash))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def read(self, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        num_bytes = dtype.itemsize * int(np.prod(shape))
        try:
            raw = np.fromfile(self.path(block_hash), dtype=np.uint8)
        except OSError as exc:
            raise BlockFileError(f"block {block_hash.hex()} in {self.directory}: {exc}") from exc
        if raw.size != num_bytes:
            raise BlockFileError(f"block {block_hash.hex()} in {self.directory} has {raw.size} bytes, "
                                 f"expected {num_bytes}")
        return torch.from_numpy(raw).view(dtype).view(shape)

    def move(self, block_hash: bytes, target: BlockFiles) -> None:
        """Copy the file into `target` (another filesystem, often), then remove it here."""
        source = self.path(block_hash)
        fd, tmp = tempfile.mkstemp(prefix=".part-", dir=target.directory)
        os.close(fd)
        try:
            shutil.copyfile(source, tmp)
            os.replace(tmp, target.path(block_hash))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        source.unlink(missing_ok=True)

    def delete(self, block_hash: bytes) -> None:
        self.path(block_hash).unlink(missing_ok=True)
