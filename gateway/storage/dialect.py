"""INSERT ... ON CONFLICT for the two databases the gateway runs on."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table


def dialect_insert(dialect: str) -> Any:
    """The `insert` of the dialect: theirs has on_conflict_do_nothing/do_update."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise ValueError(f"unsupported database dialect {dialect!r} (use sqlite or postgresql)")
    return insert


def upsert(dialect: str, table: Table) -> Any:
    """INSERT that overwrites every non-key column of a row that already exists."""
    stmt = dialect_insert(dialect)(table)
    keys = [c.name for c in table.primary_key.columns]
    return stmt.on_conflict_do_update(index_elements=keys,
                                      set_={c.name: stmt.excluded[c.name] for c in table.columns if c.name not in keys})
