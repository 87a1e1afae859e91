"""The record journal: a process killed with records still queued loses none of them,
the journal's files stay bounded, and what it cannot read costs only that line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from sqlalchemy.ext.asyncio import create_async_engine

from kvrelay.gateway.storage import RecordWriter, RequestRow
from kvrelay.gateway.storage import journal as journal_module
from kvrelay.gateway.storage.journal import SEGMENT_RECORDS, RecordJournal
from tests.gateway.storage.test_records_db import count_rows, record

_KILLED = textwrap.dedent("""
    import asyncio, os, signal, sys
    from sqlalchemy.ext.asyncio import create_async_engine
    from kvrelay.gateway.storage import RecordWriter
    from kvrelay.gateway.storage.journal import RecordJournal
    from tests.gateway.storage.test_records_db import record

    async def main():
        writer = RecordWriter(create_async_engine(sys.argv[1]), 1000, 64, RecordJournal(__import__("pathlib").Path(sys.argv[2])))
        for i in range(50):  # queued, never written: the writer is not started
            writer.submit(record(i))
        print("queued", flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
""")


async def test_records_queued_by_a_killed_process_are_written_by_the_next_one(db_url, tmp_path):
    journal_dir = tmp_path / "journal"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, db_url, str(journal_dir)], stdout=subprocess.PIPE,
                            cwd=os.getcwd())
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"queued"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert await count_rows(db_url, RequestRow) == 0
    with (next(journal_dir.glob("slot-0/records-*.jsonl"))).open("ab") as f:
        f.write(b'{"id": "req-cut-by-the-ki')  # the kill's half-written line
    engine = create_async_engine(db_url)
    journal = RecordJournal(journal_dir)
    writer = RecordWriter(engine, 1000, 64, journal)
    writer.start()
    writer.submit(record(1000))
    await writer.close()
    await engine.dispose()
    assert await count_rows(db_url, RequestRow) == 51
    assert journal.num_errors == 1
    assert [p.stat().st_size for p in journal_dir.glob("slot-*/records-*.jsonl")] == [0]  # all written: emptied


def test_segments_are_deleted_once_their_records_are_written(tmp_path):
    journal = RecordJournal(tmp_path)
    segments = journal.directory
    for i in range(3 * SEGMENT_RECORDS):
        journal.append(record(i))
    assert len(list(segments.glob("*.jsonl"))) == 3
    journal.done(SEGMENT_RECORDS + 10)
    assert len(list(segments.glob("*.jsonl"))) == 2
    journal.done(2 * SEGMENT_RECORDS - 10)
    files = list(segments.glob("*.jsonl"))
    assert len(files) == 1 and files[0].stat().st_size == 0
    journal.append(record(99999))
    journal.close()
    assert len(RecordJournal(tmp_path).leftovers()) == 1  # only what is not written yet


def test_processes_sharing_a_directory_each_take_a_slot_and_a_dead_ones_is_taken_over(tmp_path):
    first, second = RecordJournal(tmp_path), RecordJournal(tmp_path)
    assert first.directory != second.directory  # two live writers never share segments
    first.append(record(1))
    first.close()  # as a killed process's lock goes with it
    third = RecordJournal(tmp_path)
    assert third.directory == first.directory and [r.id for r in third.leftovers()] == ["req-1"]
    assert second.leftovers() == []
    second.close()
    third.close()


def test_a_journal_it_cannot_write_costs_only_the_journal(tmp_path, monkeypatch):
    journal = RecordJournal(tmp_path)
    journal.append(record(1))

    def full_disk(fd: int, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_module.os, "write", full_disk)
    journal.append(record(2))  # logged and counted, not raised: the record still goes to the queue
    assert journal.num_errors == 1
    monkeypatch.undo()
    journal.append(record(3))
    journal.close()
    assert [r.id for r in RecordJournal(tmp_path).leftovers()] == ["req-1", "req-3"]
