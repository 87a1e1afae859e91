"""The CLI turns bad input into one line on stderr and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from kvrelay.cli import main; sys.argv = ['kvrelay', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("engine", "--model", "/nonexistent/model"), "not a directory with config.json"),
        (("engine", "--port", "0"), "--port"),
        (("engine", "--bogus"), "No such option"),
        (("engine", "--host", "0.0.0.0"), "set KVRELAY_PLAN_SECRET"),  # beyond loopback: sealed plans only
        (("bench", "nope"), "unknown benchmark 'nope'"),
        (("bench", "agents", "--family", "huge"), "no family 'huge' (families: short, long)"),
        (("bench", "gateway", "--family", "long"), "no family 'long' (it has one workload family)"),
        (("engine", "--reuse-method", "magic"), "--reuse-method"),
        (("up", "--check-layers", "one"), "--check-layers"),
        (("engine", "--blend-ratio", "2"), "--blend-ratio"),
        (("engine", "--kvcomm-correction", "offsets"), "--kvcomm-correction"),
        (("up", "--anchor-pool-size", "4", "--anchor-prune-window", "5"), "prune_window must be at most anchors.max_anchors"),
        (("engine", "--anchor-gamma", "1.5"), "--anchor-gamma"),
        (("up", "--round-window-ms", "-1"), "--round-window-ms"),
        (("engine", "--round-window-ms", "20000"), "--round-window-ms"),
        (("engine", "--kv-policy", "fifo"), "--kv-policy"),
        (("up", "--kv-policy", "lru", "--load-ahead", "2", "--host-kv-mb", "64"), "needs the workflow policy"),
        (("engine", "--kv-policy", "workflow", "--load-ahead", "2", "--host-kv-mb", "0"), "needs a host or disk tier"),
        (("engine", "--disk-kv-dir", "/tmp/kv"), "needs both tiers.disk_path and tiers.disk_bytes"),
        (("up", "--disk-kv-mb", "64"), "needs both tiers.disk_path and tiers.disk_bytes"),
        (("engine", "--host-kv-mb", "-1"), "--host-kv-mb"),
        (("train", "magic", "--data", "x.jsonl", "--out", "out"), "unknown training mode 'magic'"),
        (("engine", "--adapter", "no-equals-sign"), "expected NAME=PATH"),
        (("up", "--adapter", "a:b=/tmp/x"), "without ':' or '/'"),
        (("engine", "--adapter", "a=/tmp/x", "--adapter-first-token", "middle"), "--adapter-first-token"),
        (("up", "--adapter", "a=/tmp/x", "--adapter-mode", "dense"), "--adapter-mode"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvrelay: error: ") and message in lines[0]


def test_engine_refuses_a_model_it_cannot_serve(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    proc = run_cli("engine", "--model", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("kvrelay: error: ")


def test_help_lists_the_commands():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("engine", "bench", "prepare-model"):
        assert command in proc.stdout


def test_keys_create_list_revoke_round_trip(tmp_path):
    db = ["--database-url", f"sqlite+aiosqlite:///{tmp_path / 'keys.sqlite'}"]
    created = run_cli("keys", "create", "ci-bot", "--rpm", "60", *db)
    assert created.returncode == 0, created.stderr
    key_id, secret = created.stdout.split()
    assert key_id.startswith("key_") and secret.startswith("kvr-")
    listed = run_cli("keys", "list", *db).stdout
    assert key_id in listed and "rpm=60" in listed and "active" in listed and secret not in listed
    assert run_cli("keys", "revoke", key_id, *db).returncode == 0
    assert "revoked" in run_cli("keys", "list", *db).stdout


@pytest.mark.parametrize(("args", "message"), [
    (("keys", "revoke", "key_nope"), "no API key with id 'key_nope'"),
    (("keys", "create", " "), "a key needs a name"),
    (("keys", "create", "x", "--tpm", "0"), "--tpm"),
])
def test_keys_bad_input_is_one_line(tmp_path, args, message):
    proc = run_cli(*args, "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'keys.sqlite'}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvrelay: error: ") and message in lines[0], proc.stderr


@pytest.mark.parametrize("command", ["gateway", "engine"])
def test_servers_refuse_an_unknown_trace_exporter_in_one_line(tmp_path, llama_dir, command):
    import os

    env = {**os.environ, "OTEL_TRACES_EXPORTER": "zipkin", "KVRELAY_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/g.db"}
    args = ["gateway"] if command == "gateway" else ["engine", "--model", str(llama_dir), "--port", "1"]
    code = "import sys; from kvrelay.cli import main; sys.argv = ['kvrelay', *sys.argv[1:]]; main()"
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [\
        "kvrelay: error: OTEL_TRACES_EXPORTER: unknown exporter 'zipkin' (use otlp, console or none)"]


def test_bad_gateway_settings_name_the_field_but_never_echo_the_value(tmp_path):
    import os

    env = {**os.environ, "KVRELAY_ADMIN_KEY": "short-secret", "KVRELAY_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/g.db"}
    code = "import sys; from kvrelay.cli import main; sys.argv = ['kvrelay', 'gateway']; main()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvrelay: error: invalid gateway settings: admin_key: Value error, admin_key must be at least 16 characters"]


@pytest.mark.slow
def test_train_writes_an_adapter_the_engine_serves(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    data = Path(__file__).resolve().parents[2] / "data" / "tiny_math.jsonl"
    proc = run_cli("train", "icarus", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "a"),
                   "--steps", "2", "--max-examples", "4", "--rank", "4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("loss") == 2 and (tmp_path / "a" / "adapter_model.safetensors").exists()
    bad = run_cli("train", "lora", "--model", str(model_dir), "--data", str(tmp_path / "missing.jsonl"),
                  "--out", str(tmp_path / "b"))
    assert bad.returncode == 2 and bad.stderr.strip().startswith("kvrelay: error: cannot read")
