"""The schema migrations from a regular (non-editable) install: the wheel carries the
alembic environment, and `kvrelay db upgrade` run outside the source tree builds the
schema from it. A command that works only from a checkout would fail here."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project's wheel, built from a clean copy of the sources (a build/ directory
    left in the checkout could carry files the package no longer lists) and installed
    into a directory of its own (dependencies: this venv's)."""
    out = tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    source = out / "src"
    for name in files:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(out), str(source)], check=True, capture_output=True, timeout=300)
    wheel = next(out.glob("kvrelay-*.whl"))
    site = out / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return site


def test_the_wheel_carries_the_alembic_environment(installed):
    wheel = next(installed.parent.glob("kvrelay-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"kvrelay/migrations/env.py", "kvrelay/migrations/script.py.mako",
            "kvrelay/migrations/versions/0001_records.py"} <= names
    revisions = {p.name for p in (REPO / "kvrelay" / "migrations" / "versions").glob("0*.py")}
    assert {f"kvrelay/migrations/versions/{name}" for name in revisions} <= names


def test_the_wheel_installs_only_kvrelay_s_own_top_level_names(installed):
    """Generic names (gateway, kernels, migrations, benchmarks) would shadow, or be shadowed
    by, other distributions installing the same ones; the UI's assets still ship."""
    wheel = next(installed.parent.glob("kvrelay-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"kvrelay", "engine_ext"}
    assert "kvrelay/gateway/ui/static/vendor/cytoscape.min.js" in names
    assert "engine_ext/kernels/shift_copy.py" in names


def test_bench_from_an_installed_package_says_where_the_benchmarks_are(installed, tmp_path):
    env = {"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    command = "import sys; from kvrelay.cli import main; sys.argv = ['kvrelay', 'bench', 'engine']; main()"
    run = subprocess.run([sys.executable, "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr[-2000:]
    assert "the benchmarks run from kvrelay's source checkout" in run.stderr


def test_db_upgrade_runs_from_an_installed_package_outside_the_sources(installed, tmp_path):
    db = tmp_path / "records.sqlite"
    env = {"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    where = subprocess.run([sys.executable, "-c", "import kvrelay.migrations, kvrelay.gateway; print(kvrelay.migrations.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.strip().startswith(str(installed)), where.stdout  # not the checkout's copy
    command = ("import sys; from kvrelay.cli import main; "
               f"sys.argv = ['kvrelay', 'db', 'upgrade', '--database-url', 'sqlite+aiosqlite:///{db}']; main()")
    run = subprocess.run([sys.executable, "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    tables = {row[0] for row in sqlite3.connect(db).execute("select name from sqlite_master where type='table'")}
    assert {"requests", "sessions", "agents", "api_keys", "alembic_version"} <= tables
