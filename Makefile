# One entry point for setting up, serving and checking hicached.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install serve test check lint typecheck pytest bench clean

# Mooncake's wheel needs libibverbs even for TCP; install it when missing (root only).
SYSTEM_STAMP := $(VENV)/.system

$(SYSTEM_STAMP):
	@mkdir -p $(VENV)
	@if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; \
		else \
			echo "libibverbs1 is missing: run 'sudo apt-get install libibverbs1' (needed by the mooncake backend)"; exit 1; \
		fi; \
	fi
	@touch $(SYSTEM_STAMP)

$(STAMP): pyproject.toml $(SYSTEM_STAMP)
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
