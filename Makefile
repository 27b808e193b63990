# The two documented commands are `make demo` and `make test`; the rest are their parts.
# `deps` is idempotent: on a fresh Debian 12 machine (as root) it installs PostgreSQL,
# ZooKeeper and RabbitMQ from apt, creates .venv and installs the project; on later runs it
# does nothing.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Inside .venv, so deleting the venv also forgets that it was installed.
STAMP := $(VENV)/.schedctl-deps.stamp
ZOOKEEPER_JAR := /usr/share/java/zookeeper.jar
# Tests start their own broker (tests/services/rabbitmq.py); the package's service, if apt
# started one, is stopped again right after the install.
RABBITMQ_SERVER := /usr/lib/rabbitmq/bin/rabbitmq-server

.PHONY: deps system-deps lint test demo clean distclean

deps: system-deps $(STAMP)

system-deps:
	@packages=""; \
	bindir="$$(pg_config --bindir 2>/dev/null || true)"; \
	if [ -z "$$bindir" ] || [ ! -x "$$bindir/initdb" ] || [ ! -x "$$bindir/pg_ctl" ]; then \
		if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
			packages="$$packages postgresql"; \
		fi; \
	fi; \
	if [ ! -f "$(ZOOKEEPER_JAR)" ] || ! command -v java >/dev/null 2>&1; then \
		packages="$$packages zookeeper"; \
	fi; \
	if [ ! -x "$(RABBITMQ_SERVER)" ]; then \
		packages="$$packages rabbitmq-server"; \
	fi; \
	if [ ! -x "$(BIN)/python" ] && ! $(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1; then \
		packages="$$packages python3-venv"; \
	fi; \
	if [ -n "$$packages" ]; then \
		if [ "$$(id -u)" != 0 ]; then \
			echo "missing system packages:$$packages -- run 'make deps' as root (apt-get)" >&2; \
			exit 1; \
		fi; \
		echo "installing system packages:$$packages"; \
		apt-get update; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y $$packages; \
		case "$$packages" in *rabbitmq-server*) \
			if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then \
				systemctl stop rabbitmq-server.service epmd.socket epmd.service || true; \
			fi;; \
		esac; \
	fi

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when pyproject.toml changed since the last install.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[dev]'
	touch $@

lint: deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: deps
	$(MAKE) --no-print-directory lint
	$(BIN)/pytest

demo: deps
	$(BIN)/python -m scheduled_d.demo

clean:
	rm -rf build dist .mypy_cache .ruff_cache .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name '*.egg-info' -prune -exec rm -rf {} + \
		-o -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
