# One entry point for setting up, serving and checking hicached.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install serve test check lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,torch]'
	touch $(STAMP)

install: $(STAMP)

## Run the daemon in the foreground on built-in defaults (or CONFIG=path).
serve: $(STAMP)
	$(VENV)/bin/hicached serve $(if $(CONFIG),--config $(CONFIG))

## Install everything, then lint, type-check and run the whole test suite.
test: $(STAMP) check

check: lint typecheck pytest

lint:
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

typecheck:
	$(VENV)/bin/mypy

pytest:
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

## Benchmarks: JSON on stdout, one object per command.
bench: $(STAMP)
	$(VENV)/bin/hicached bench control --json
	$(VENV)/bin/hicached bench data --json

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
