# Set-up and checks. `make run`: install and run the compile-and-run harness with its defaults (profile the
# cost model here, then train with each policy on 4 local ranks); `make test`: install and run the suite.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: install run test bench plan clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is installed first, pinned, so that no dependency range can pull a multi-GB CUDA build.
install: $(BIN)/python
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[dev,triton]"

run: install
	$(BIN)/python -m benchmarks.e2e

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m benchmarks.planner

plan: install
	$(BIN)/hcompile plan --model llama-32b --hardware a800-80g --gpus 64 --dataset commoncrawl \
		--global-tokens 200000 --steps 30 --seed 0

clean:
	rm -rf $(VENV) results .pytest_cache .hypothesis
