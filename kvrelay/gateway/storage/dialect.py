"""INSERT ... ON CONFLICT for the two databases the gateway runs on."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from sqlalchemy import Table

if TYPE_CHECKING:
    from sqlalchemy.dialects.postgresql import Insert as PostgresqlInsert
    from sqlalchemy.dialects.sqlite import Insert as SqliteInsert

    DialectInsert: TypeAlias = PostgresqlInsert | SqliteInsert


def dialect_insert(dialect: str) -> Callable[[Table], DialectInsert]:
    """The `insert` of the dialect: theirs has on_conflict_do_nothing/do_update."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as postgresql_insert
        return postgresql_insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert
        return sqlite_insert
    else:
        raise ValueError(f"unsupported database dialect {dialect!r} (use sqlite or postgresql)")


def upsert(dialect: str, table: Table) -> DialectInsert:
    """INSERT that overwrites every non-key column of a row that already exists."""
    stmt = dialect_insert(dialect)(table)
    keys = [c.name for c in table.primary_key.columns]
    return stmt.on_conflict_do_update(index_elements=keys,
                                      set_={c.name: stmt.excluded[c.name] for c in table.columns if c.name not in keys})
