#!/usr/bin/env bash
# Run a command with a throwaway PostgreSQL cluster on loopback, exported to it as
# KVRELAY_TEST_POSTGRES_URL. Without PostgreSQL binaries the command runs alone and the
# PostgreSQL tests skip, saying why (.ci/run installs PostgreSQL, so CI always has it).
set -euo pipefail
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$bindir" ] || [ ! -x "$bindir/initdb" ]; then
    echo "with-postgres: no PostgreSQL found; PostgreSQL tests will be skipped" >&2
    exec "$@"
fi
port=${KVRELAY_TEST_PG_PORT:-55432}
data=$(mktemp -d /tmp/kvrelay-pg.XXXXXX)
as_pg=()
if [ "$(id -u)" = 0 ]; then
    chown postgres:postgres "$data"
    as_pg=(runuser -u postgres --)
fi
cleanup() { "${as_pg[@]}" "$bindir/pg_ctl" -D "$data" -m fast stop >/dev/null 2>&1 || true; rm -rf "$data"; }
trap cleanup EXIT
"${as_pg[@]}" "$bindir/initdb" -D "$data" -A trust -U postgres >/dev/null
"${as_pg[@]}" "$bindir/pg_ctl" -D "$data" -w -l "$data/log" \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $data" start >/dev/null
export KVRELAY_TEST_POSTGRES_URL="postgresql+asyncpg://postgres@127.0.0.1:$port/postgres"
export KVRELAY_TEST_PG_CTL="${as_pg[*]} $bindir/pg_ctl -D $data -l $data/log -o '-c listen_addresses=127.0.0.1 -p $port -k $data'"
"$@"
