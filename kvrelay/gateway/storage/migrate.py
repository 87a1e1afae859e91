"""Schema migrations through alembic, callable from the CLI and at gateway start-up."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config

from kvrelay import migrations

# The installed `migrations` package (its env.py, script.py.mako and versions/): found
# through the import system, so a regular install works as well as a source checkout.
MIGRATIONS_DIR = Path(str(resources.files(migrations)))


def alembic_config(database_url: str) -> Config:
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(f"alembic environment not found at {MIGRATIONS_DIR}")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Bring the schema to `revision`. Synchronous: env.py runs its own event loop."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)
