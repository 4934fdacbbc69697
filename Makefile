# One entry point for setting up, serving, checking and installing hicached.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Development: everything (tools, backends' packages, torch), with the versions
# the tests run against held by the constraints file.
STAMP  := $(VENV)/.installed
CONSTRAINTS := constraints-dev.txt
# `make serve`: the daemon's own dependencies only.
RUNTIME_STAMP := $(VENV)/.runtime

.PHONY: install serve test check lint typecheck pytest bench clean system-deps install-service test-pythons test-lowest

## System packages the test suite needs: the mooncake wheel loads libibverbs
## even for TCP. `make test` asks for this step; it says what it installs, and
## runs apt-get only as root (otherwise it prints the command to run).
system-deps:
	@if ldconfig -p | grep -q 'libibverbs.so.1 '; then \
		echo "system-deps: libibverbs1 is installed"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "system-deps: installing the Debian package libibverbs1 (apt-get, as root) for the mooncake backend"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; \
	else \
		echo "system-deps: libibverbs1 is missing: run 'sudo apt-get install libibverbs1' (needed by the mooncake backend)"; \
		exit 1; \
	fi

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev,torch]'
	touch $(STAMP)

$(RUNTIME_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e .
	touch $(RUNTIME_STAMP)

install: $(STAMP)

## Run the daemon in the foreground on built-in defaults (or CONFIG=path);
## installs the runtime dependencies only.
serve: $(RUNTIME_STAMP)
	$(VENV)/bin/hicached serve $(if $(CONFIG),--config $(CONFIG))

## Install everything, then lint, type-check and run the whole test suite.
test: system-deps $(STAMP) check

check: lint typecheck pytest

lint:
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

typecheck:
	$(VENV)/bin/mypy

pytest:
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

## The package on other Pythons than the development venv's (3.10 is the
## oldest it runs on: Ubuntu 22.04's python3): for each interpreter in
## OTHER_PYTHONS, a venv of its own (.venv-VERSION, without torch) and the
## tests of the daemon, its clients and their bad input and races.
OTHER_PYTHONS ?= python3.10 python3.13
PYTHON_TESTS  ?= tests/test_daemon.py tests/test_daemon_waits.py tests/test_bad_input.py \
	tests/test_client_races.py tests/test_bounds.py tests/test_reload.py tests/test_l3.py
test-pythons:
	@set -e; for py in $(OTHER_PYTHONS); do \
		ver=$$($$py -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
		venv=.venv-$$ver; \
		echo "test-pythons: Python $$ver ($$py) in $$venv"; \
		[ -x $$venv/bin/python ] || $$py -m venv $$venv; \
		grep -v '^torch' $(CONSTRAINTS) > $$venv/constraints.txt; \
		$$venv/bin/python -m pip install -q -c $$venv/constraints.txt -e '.[dev]'; \
		$$venv/bin/python -m pytest -q -p no:cacheprovider $(PYTHON_TESTS); \
	done

## The same tests on the oldest versions of the runtime dependencies that
## pyproject.toml allows (constraints-lowest.txt; an engine's venv may hold
## them), in .venv-lowest, on the development venv's Python.
test-lowest:
	@[ -x .venv-lowest/bin/python ] || $(PYTHON) -m venv .venv-lowest
	.venv-lowest/bin/python -m pip install -q -c constraints-lowest.txt -e '.[dev]'
	.venv-lowest/bin/python -m pip check
	.venv-lowest/bin/python -m pytest -q -p no:cacheprovider $(PYTHON_TESTS)

## Benchmarks: JSON on stdout, one object per command.
bench: $(STAMP)
	$(VENV)/bin/hicached bench control --json
	$(VENV)/bin/hicached bench data --json

## Install the daemon as a systemd service (as root; docs/operations.md):
## a venv of its own at PREFIX holding hicached built as a wheel and its
## runtime dependencies (EXTRAS=s3,mooncake adds backends' packages), the
## unit with PREFIX and CONFDIR filled in, the sysusers.d and tmpfiles.d
## files, the config (an existing one is kept, never overwritten), and a
## drop-in with ReadWritePaths= for configured paths outside the unit's own
## directories. DESTDIR stages the files outside the venv for packaging
## (the venv itself is built at PREFIX: a venv cannot move).
PREFIX         ?= /opt/hicached
SERVICE_PYTHON ?= /usr/bin/python3
EXTRAS         ?=
CONFDIR        ?= /etc/hicached
UNITDIR        ?= /etc/systemd/system
SYSUSERSDIR    ?= /etc/sysusers.d
TMPFILESDIR    ?= /etc/tmpfiles.d
WHEEL_DIR      ?= dist
# Names fixed by systemd/hicached.sysusers and the unit.
SERVICE_USER   := hicached
CLIENT_GROUP   := hicached-clients

install-service:
	@test -x $(SERVICE_PYTHON) || { echo "install-service: $(SERVICE_PYTHON) not found: give SERVICE_PYTHON=/path/to/python3 (3.10 or newer, outside /root and /home)"; exit 1; }
	@echo "install-service: venv at $(PREFIX) (from $(SERVICE_PYTHON))"
	$(SERVICE_PYTHON) -m venv $(PREFIX)
	rm -f $(WHEEL_DIR)/hicached-*.whl
	$(PREFIX)/bin/python -m pip wheel -q --no-deps -w $(WHEEL_DIR) .
	wheel=$$(ls $(WHEEL_DIR)/hicached-*.whl) && \
		$(PREFIX)/bin/python -m pip install -q "$$wheel$(if $(EXTRAS),[$(EXTRAS)])" && \
		$(PREFIX)/bin/python -m pip install -q --no-deps --force-reinstall "$$wheel"
	install -d -m 0755 $(DESTDIR)$(SYSUSERSDIR) $(DESTDIR)$(TMPFILESDIR) $(DESTDIR)$(UNITDIR) \
		$(DESTDIR)$(CONFDIR) $(PREFIX)/share/doc/hicached
	install -m 0644 systemd/hicached.sysusers $(DESTDIR)$(SYSUSERSDIR)/hicached.conf
	install -m 0644 systemd/hicached.tmpfiles $(DESTDIR)$(TMPFILESDIR)/hicached.conf
	install -m 0644 docs/operations.md $(PREFIX)/share/doc/hicached/operations.md
	@if [ -z "$(DESTDIR)" ]; then \
		echo "install-service: creating user $(SERVICE_USER) and group $(CLIENT_GROUP) (systemd-sysusers)"; \
		systemd-sysusers $(SYSUSERSDIR)/hicached.conf || exit 1; \
	fi
	@if [ -e $(DESTDIR)$(CONFDIR)/hicached.toml ]; then \
		echo "install-service: keeping $(DESTDIR)$(CONFDIR)/hicached.toml"; \
	else \
		sed 's/^client_group = ""/client_group = "$(CLIENT_GROUP)"/' config/hicached.toml \
			> $(DESTDIR)$(CONFDIR)/hicached.toml.new && \
		chmod 0640 $(DESTDIR)$(CONFDIR)/hicached.toml.new && \
		{ [ -n "$(DESTDIR)" ] || chgrp $(SERVICE_USER) $(DESTDIR)$(CONFDIR)/hicached.toml.new; } && \
		mv $(DESTDIR)$(CONFDIR)/hicached.toml.new $(DESTDIR)$(CONFDIR)/hicached.toml && \
		echo "install-service: wrote $(DESTDIR)$(CONFDIR)/hicached.toml (server.client_group = $(CLIENT_GROUP))"; \
	fi
	sed -e 's|/opt/hicached|$(PREFIX)|g' -e 's|/etc/hicached|$(CONFDIR)|g' systemd/hicached.service \
		> $(DESTDIR)$(UNITDIR)/hicached.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/hicached.service
	$(PREFIX)/bin/python systemd/hicached-paths.py $(DESTDIR)$(CONFDIR)/hicached.toml \
		$(DESTDIR)$(UNITDIR)/hicached.service.d/50-paths.conf $(if $(DESTDIR),,--create)
	@if [ -z "$(DESTDIR)" ]; then \
		systemd-tmpfiles --create $(TMPFILESDIR)/hicached.conf; \
		if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi; \
		echo "install-service: done; start it with 'systemctl enable --now hicached'"; \
		echo "install-service: engines connect as members of $(CLIENT_GROUP) (usermod -aG $(CLIENT_GROUP) USER)"; \
	fi

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
