"""The records not yet in SQL, on local disk: a killed gateway loses none of them.

The record writer keeps records in memory until their batch commits; a process killed in
between (SIGKILL, OOM, a host's restart of one replica) would take them along. With
`record_journal_dir` set, each record is also appended to a journal file as it is queued
(one `write` of one JSON line, no fsync: it survives the process, not a power cut), and a
journal segment is deleted once every record in it is written or quarantined. At start
the gateway re-queues what a previous process left in that directory; the insert ignores
a record already written, so replaying one twice is harmless.

Segments roll over every `SEGMENT_RECORDS` records, so the journal's size is bounded by
the writer's backlog, not by uptime.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import uuid
from collections import deque
from dataclasses import asdict, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from kvrelay.gateway.storage.writer import RequestRecord

logger = logging.getLogger(__name__)

SEGMENT_RECORDS = 1024
_DATES = {f.name for f in fields(RequestRecord) if f.name.endswith("_at")}


def _encode(record: RequestRecord) -> bytes:
    row: dict[str, Any] = asdict(record)
    for name in _DATES:
        if isinstance(row[name], datetime):
            row[name] = row[name].isoformat()
    return (json.dumps(row, ensure_ascii=True) + "\n").encode()


def _decode(line: bytes) -> RequestRecord:
    row = json.loads(line)
    for name in _DATES:
        if row.get(name) is not None:
            row[name] = datetime.fromisoformat(row[name])
    return RequestRecord(**row)


MAX_SLOTS = 256


def claim_slot(directory: Path) -> tuple[Path, int]:
    """The first slot of `directory` no live process holds: its folder and the descriptor
    of its lock, held until this process ends (a killed process's lock goes with it). So
    gateway workers can share one `record_journal_dir`, and the one that replaces a killed
    worker takes over its slot and what it left there."""
    directory.mkdir(parents=True, exist_ok=True)
    for n in range(MAX_SLOTS):
        fd = os.open(directory / f"slot-{n}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        slot = directory / f"slot-{n}"
        slot.mkdir(exist_ok=True)
        return slot, fd
    raise OSError(f"all {MAX_SLOTS} journal slots of {directory} are held by live processes")


class RecordJournal:
    """Append-only segments `records-<token>-<first index>.jsonl` in a slot of one directory
    (`claim_slot`), which this process owns while it runs. Records are counted in queue
    order; `done(n)` says the next n are in SQL (or quarantined)."""

    def __init__(self, directory: Path) -> None:
        self.directory, lock = claim_slot(directory)
        self._lock: int | None = lock
        self._token = uuid.uuid4().hex[:12]  # this process's segments; never a previous one's name (pid 1 in a container)
        self._old = sorted(self.directory.glob("records-*.jsonl"))  # a previous process's
        self._fd: int | None = None
        self._next = 0  # index of the next record appended
        self._done = 0  # records before this index are written or quarantined
        self._segments: deque[tuple[int, Path]] = deque()  # (first index, path), oldest first
        self.num_errors = 0

    def leftovers(self) -> list[RequestRecord]:
        """What a previous process journaled and may not have written. Lines it cannot
        read (the last one, cut by the kill) are skipped and counted."""
        records: list[RequestRecord] = []
        for path in self._old:
            for line in path.read_bytes().splitlines():
                try:
                    records.append(_decode(line))
                except (ValueError, TypeError) as exc:
                    self.num_errors += 1
                    logger.warning("journal %s: a line that cannot be read (%s)", path.name, exc)
        return records

    def forget_leftovers(self) -> None:
        """Delete the previous process's segments, once their records are journaled again."""
        for path in self._old:
            path.unlink(missing_ok=True)
        self._old = []

    def append(self, record: RequestRecord) -> None:
        """Never raises: a journal that cannot be written is logged and counted, and the
        record still goes to the writer's queue."""
        try:
            if self._fd is None or (self._next - self._segments[-1][0]) >= SEGMENT_RECORDS:
                self._roll()
            assert self._fd is not None
            os.write(self._fd, _encode(record))
        except OSError as exc:
            self.num_errors += 1
            logger.error("record %s not journaled (%s)", record.id, exc)
        self._next += 1

    def done(self, count: int) -> None:
        """The next `count` records in queue order are written or quarantined: delete the
        segments that hold nothing else, and empty the open one once all are."""
        self._done += count
        try:
            while len(self._segments) > 1 and self._done >= self._segments[1][0]:
                self._segments.popleft()[1].unlink(missing_ok=True)
            if self._fd is not None and self._done >= self._next:
                os.ftruncate(self._fd, 0)
        except OSError as exc:
            self.num_errors += 1
            logger.warning("journal not trimmed (%s); a restart re-queues written records, which are ignored", exc)

    def _roll(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        path = self.directory / f"records-{self._token}-{self._next:012d}.jsonl"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._segments.append((self._next, path))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock is not None:
            os.close(self._lock)  # releases the slot
            self._lock = None
