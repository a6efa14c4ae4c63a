# agentmw: two commands matter. `make demo` runs the whole system offline; `make test` runs the tests.
# Every target sets up what it needs (virtual environment, packages, generated stubs) on its own.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PROTOS := $(wildcard protos/agentmw/v1/*.proto)
STUBS  := agentmw/v1/.stamp

.PHONY: install protos test demo bench lint clean mem0

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (Python 3.11 is required)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip check
	touch $@

install: $(VENV)/.installed $(STUBS)
	@if ! command -v npm >/dev/null; then echo "npm not found: the Node.js example middleware is skipped"; \
	elif [ ! -f mw_servers/examples/node/node_modules/.package-lock.json ] || \
	     [ mw_servers/examples/node/package-lock.json -nt mw_servers/examples/node/node_modules/.package-lock.json ]; then \
	  npm ci --prefix mw_servers/examples/node --no-audit --no-fund || \
	  echo "npm ci failed: tests/test_node_middleware.py will say why"; fi

# Python stubs for protos/agentmw/v1/*.proto, into the importable package agentmw.v1.
$(STUBS): $(PROTOS) $(VENV)/.installed
	$(PY) -m agent_host.protogen
	touch $@

protos: $(VENV)/.installed
	$(PY) -m agent_host.protogen

test: install mem0
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

demo: install mem0
	$(PY) -m clients.demo

# The peer to beat, AgentScope 2.0.11 in-process, lives in its own venv (never in .venv).
AS_VENV := .venv-agentscope
$(AS_VENV)/.installed:
	$(PYTHON) -m venv $(AS_VENV)
	$(AS_VENV)/bin/python -m pip install --quiet agentscope==2.0.11
	touch $@

# The built-in servers' rows need the mem0 server's venv (make mem0, below).
bench: install mem0 $(AS_VENV)/.installed
	BENCH_AGENTSCOPE_PYTHON=$(CURDIR)/$(AS_VENV)/bin/python $(PY) -m bench.run

# The mem0 server's own venv (torch, sentence-transformers, mem0ai; ~1.9 GB, a few minutes once):
# the host's .venv stays free of them. Tests and the demo run the server with its python.
MEM0_VENV := .venv-mem0
$(MEM0_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(MEM0_VENV)
	$(MEM0_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MEM0_VENV)/bin/python -m pip install --quiet -e '.[mem0]'
	$(MEM0_VENV)/bin/python -m pip check
	touch $@

mem0: $(MEM0_VENV)/.installed $(STUBS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(AS_VENV) $(MEM0_VENV) agentmw/v1
