"""The gateway's alembic environment and revisions, installed with the package (not only
next to the sources), so `kvrelay db upgrade` and the gateway's start-up upgrade work
from a regular install (kvrelay/gateway/storage/migrate.py)."""
