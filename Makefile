# Set-up and checks. `make run`: install and run the compile-and-run harness with its defaults (profile the
# cost model here, then train with each policy on 4 local ranks); `make test`: install and run the suite
# (`make test-full`: its exhaustive sweeps too); `make lint`: ruff (E, F, I, B) over the tree and mypy over the planner.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install run test test-full lint bench plan clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is installed first, pinned, so that no dependency range can pull a multi-GB CUDA build. The stamp
# makes a second `make test` skip the install when neither the project file nor this one changed.
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[dev,triton]"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/python -m benchmarks.e2e

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Every test, the exhaustive sweeps marked `slow` too (tests/conftest.py); about twice as long as `make test`.
test-full: install
	HYDRAULIS_FULL_TESTS=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: install
	$(BIN)/python -m benchmarks.planner

plan: install
	$(BIN)/hcompile plan --model llama-32b --hardware a800-80g --gpus 64 --dataset commoncrawl \
		--global-tokens 200000 --steps 30 --seed 0

clean:
	rm -rf $(VENV) results .pytest_cache .hypothesis
