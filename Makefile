# The two documented commands are `make demo` and `make test`; the rest are their parts.
# `deps` is idempotent: on a fresh Debian 12 machine (as root) it installs PostgreSQL,
# ZooKeeper, RabbitMQ and Patroni from apt, creates .venv and installs the project; on
# later runs it does nothing.
# Operators: `make install` / `make uninstall` (as root; PREFIX=/usr/local, DESTDIR= stages
# below a directory and leaves the machine alone), `make onefile`: dist/scheduled.pyz,
# schedctl and scheduled-d in one executable file, and `make deb`: the Debian package
# dist/scheduled_VERSION_amd64.deb (needs dpkg-dev; lintian checks it). All are described
# at their targets below and in docs/install.md.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Inside .venv, so deleting the venv also forgets that it was installed.
STAMP := $(VENV)/.schedctl-deps.stamp
ZOOKEEPER_JAR := /usr/share/java/zookeeper.jar
# ZooKeeper's TLS client port (NettyServerCnxnFactory) needs netty-codec and its peers,
# which zookeeper.jar's manifest does not list: libnetty-java (a dependency of zookeeper
# today; named so that a slimmer package would not silently drop the TLS tests)
NETTY_CODEC_JAR := /usr/share/java/netty-codec.jar
# Tests start their own broker (tests/services/rabbitmq.py); the package's service, if apt
# started one, is stopped again right after the install.
RABBITMQ_SERVER := /usr/lib/rabbitmq/bin/rabbitmq-server
# The Postgres failover tests (tests/chaos/test_patroni.py) run a 2-node Patroni cluster on
# the tests' ZooKeeper: Debian's patroni runs on /usr/bin/python3, which needs kazoo for it.
PATRONI := /usr/bin/patroni

.PHONY: deps system-deps lint test demo clean distclean config

deps: system-deps $(STAMP)

# chromium and chromium-driver: the web console's browser test
# (tests/integration/test_console_browser.py)
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
	if [ ! -f "$(NETTY_CODEC_JAR)" ]; then \
		packages="$$packages libnetty-java"; \
	fi; \
	if [ ! -x "$(RABBITMQ_SERVER)" ]; then \
		packages="$$packages rabbitmq-server"; \
	fi; \
	if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		packages="$$packages chromium chromium-driver"; \
	fi; \
	if ! command -v promtool >/dev/null 2>&1; then \
		packages="$$packages prometheus"; \
	fi; \
	if [ ! -x "$(PATRONI)" ] || ! /usr/bin/python3 -c 'import kazoo' >/dev/null 2>&1; then \
		packages="$$packages patroni python3-kazoo"; \
	fi; \
	if [ ! -x "$(BIN)/python" ] && ! $(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1; then \
		packages="$$packages python3-venv"; \
	fi; \
	if ! command -v dpkg-shlibdeps >/dev/null 2>&1; then \
		packages="$$packages dpkg-dev"; \
	fi; \
	if ! command -v lintian >/dev/null 2>&1; then \
		packages="$$packages lintian"; \
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
		case "$$packages" in *prometheus*) \
			if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then \
				systemctl disable --now prometheus.service prometheus-node-exporter.service \
					>/dev/null 2>&1 || true; \
			fi;; \
		esac; \
	fi

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when a pyproject.toml changed since the last install. The benchmarks
# (benchmarks/: schedctl-bench, `schedctl bench ...`) are a distribution of their own, in the
# dev venv only: install, wheelhouse, onefile and deb build the product without them.
$(STAMP): pyproject.toml benchmarks/pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[dev]'
	$(BIN)/pip install -e ./benchmarks
	touch $@

# config/scheduled.toml is generated from the configuration schema (schedctl/domain/config.py and
# the descriptions in schedctl/domain/config_doc.py); tests/unit/test_config_example.py keeps it in step
config: deps
	$(BIN)/python -m schedctl.domain.config_doc > config/scheduled.toml.new
	mv config/scheduled.toml.new config/scheduled.toml

lint: deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: deps
	$(MAKE) --no-print-directory lint
	$(BIN)/pytest -n 2

demo: deps
	$(BIN)/python -m scheduled_d.demo

clean:
	rm -rf build dist .mypy_cache .ruff_cache .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name '*.egg-info' -prune -exec rm -rf {} + \
		-o -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) wheelhouse

# ---------------------------------------------------------------------------------------
# install / uninstall: the project on this machine (as root), or staged below DESTDIR.
#
# Installed: a venv in $(INSTALL_VENV) with the project (not editable), the commands
# $(PREFIX)/bin/schedctl and scheduled-d (small Python scripts run by that venv's python),
# the man pages in $(MANDIR)/man{1,5,8}, the units in $(SYSTEMD_DIR) (ExecStart= on
# $(PREFIX)/bin/scheduled-d), /etc/scheduled/scheduled.toml (the commented example; an
# existing file is never overwritten), an empty /etc/scheduled/jobs.d, the `scheduled`
# system user and group, and /var/lib/scheduled (owned by it). Logs go to the journal.
#
# With DESTDIR set, everything goes below it and the machine itself is not touched: no
# user, no chown, no systemctl, no mandb; the installed files name their final paths
# (#! lines, pyvenv.cfg), so the tree can be copied to / as it is.
#
# uninstall removes the commands, man pages, units (stopping and disabling them first)
# and the venv, and keeps the data: /etc/scheduled, /var/lib/scheduled and the user.

PREFIX ?= /usr/local
MANDIR ?= $(PREFIX)/share/man
SYSTEMD_DIR ?= /etc/systemd/system
INSTALL_VENV ?= /opt/scheduled
# The venv's python is a link to this interpreter, so the scheduled user must be able to
# run it: the system's, not one below a home directory (pyenv's /root is 0700).
INSTALL_PYTHON ?= $(if $(wildcard /usr/bin/python3),/usr/bin/python3,$(PYTHON))
SYSCONF := /etc/scheduled
STATE_DIR := /var/lib/scheduled
# written into the venv by install; uninstall removes only a venv that has it
VENV_MARK := .scheduled-install
UNIT_FILES := $(notdir $(wildcard systemd/*.service systemd/*.timer))
MAN_PAGES := $(notdir $(wildcard man/*.[158]))
# true when the real machine is the target (no DESTDIR)
LIVE := $(if $(DESTDIR),false,true)

.PHONY: install uninstall

install:
	@if $(LIVE) && [ "$$(id -u)" != 0 ]; then \
		echo "make install: run it as root (or stage it: make install DESTDIR=/some/dir)" >&2; \
		exit 1; \
	fi
	@if ! $(INSTALL_PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1; then \
		echo "make install: $(INSTALL_PYTHON) has no venv module: apt-get install python3-venv" >&2; \
		exit 1; \
	fi
	@# the venv and the project in it; pip reinstalls the project from this tree every time
	if [ ! -x "$(DESTDIR)$(INSTALL_VENV)/bin/python" ]; then \
		$(INSTALL_PYTHON) -m venv "$(DESTDIR)$(INSTALL_VENV)"; \
	fi
	"$(DESTDIR)$(INSTALL_VENV)/bin/python" -m pip install -q --disable-pip-version-check \
		--no-compile --upgrade .
	@# staged: the venv's own #! lines and pyvenv.cfg name the final path, not DESTDIR
	if [ -n "$(DESTDIR)" ]; then \
		grep -rlsF "$(DESTDIR)$(INSTALL_VENV)" "$(DESTDIR)$(INSTALL_VENV)/bin" \
			"$(DESTDIR)$(INSTALL_VENV)/pyvenv.cfg" \
		| while read -r file; do \
			sed -i "s|$(DESTDIR)$(INSTALL_VENV)|$(INSTALL_VENV)|g" "$$file"; \
		done; \
	fi
	@# byte-compiled once here (the venv is not writable by the daemon), with final paths
	"$(DESTDIR)$(INSTALL_VENV)/bin/python" -m compileall -q -j 0 \
		$(if $(DESTDIR),-f -s "$(DESTDIR)" -p /) "$(DESTDIR)$(INSTALL_VENV)/lib" >/dev/null || true
	touch "$(DESTDIR)$(INSTALL_VENV)/$(VENV_MARK)"
	install -d "$(DESTDIR)$(PREFIX)/bin"
	printf '%s\n' '#!$(INSTALL_VENV)/bin/python' \
		'# installed by make install: schedctl from the venv in $(INSTALL_VENV)' \
		'import sys' 'from schedctl.cli.app import main' 'sys.exit(main())' \
		> "$(DESTDIR)$(PREFIX)/bin/schedctl"
	printf '%s\n' '#!$(INSTALL_VENV)/bin/python' \
		'# installed by make install: scheduled-d from the venv in $(INSTALL_VENV)' \
		'import sys' 'from scheduled_d.__main__ import main' 'sys.exit(main())' \
		> "$(DESTDIR)$(PREFIX)/bin/scheduled-d"
	chmod 0755 "$(DESTDIR)$(PREFIX)/bin/schedctl" "$(DESTDIR)$(PREFIX)/bin/scheduled-d"
	for page in $(MAN_PAGES); do \
		install -D -m 0644 "man/$$page" "$(DESTDIR)$(MANDIR)/man$${page##*.}/$$page"; \
	done
	install -d "$(DESTDIR)$(SYSTEMD_DIR)"
	for unit in $(UNIT_FILES); do \
		sed 's|/usr/local/bin/|$(PREFIX)/bin/|g' "systemd/$$unit" \
			> "$(DESTDIR)$(SYSTEMD_DIR)/$$unit"; \
		chmod 0644 "$(DESTDIR)$(SYSTEMD_DIR)/$$unit"; \
	done
	@# the system user first: the configuration and the state directory are its group's
	if $(LIVE) && ! getent passwd scheduled >/dev/null; then \
		group=--user-group; \
		if getent group scheduled >/dev/null; then group="--gid scheduled"; fi; \
		useradd --system $$group --home-dir $(STATE_DIR) --no-create-home \
			--shell /usr/sbin/nologin --comment "scheduled-d daemon" scheduled; \
	fi
	install -d -m 0755 "$(DESTDIR)$(SYSCONF)" "$(DESTDIR)$(SYSCONF)/jobs.d"
	if [ -e "$(DESTDIR)$(SYSCONF)/scheduled.toml" ]; then \
		echo "keeping the existing $(DESTDIR)$(SYSCONF)/scheduled.toml"; \
	else \
		install -m 0640 config/scheduled.toml "$(DESTDIR)$(SYSCONF)/scheduled.toml"; \
		if $(LIVE); then chgrp scheduled "$(SYSCONF)/scheduled.toml"; fi; \
	fi
	install -d -m 0750 "$(DESTDIR)$(STATE_DIR)"
	if $(LIVE); then chown scheduled:scheduled "$(STATE_DIR)"; fi
	@# the daemon runs as scheduled: it must be able to start the venv's interpreter
	if $(LIVE) && ! runuser -u scheduled -- "$(INSTALL_VENV)/bin/python" -c '' 2>/dev/null; then \
		echo "make install: the scheduled user cannot run $(INSTALL_VENV)/bin/python" \
			"($$(readlink -f $(INSTALL_VENV)/bin/python)); make uninstall, then" \
			"make install INSTALL_PYTHON=/usr/bin/python3" >&2; \
		exit 1; \
	fi
	if $(LIVE) && command -v mandb >/dev/null 2>&1; then mandb -q || true; fi
	if $(LIVE) && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then \
		systemctl daemon-reload; \
	fi
	@echo "installed: $(PREFIX)/bin/schedctl, $(PREFIX)/bin/scheduled-d (venv $(INSTALL_VENV));" \
		"next: edit $(SYSCONF)/scheduled.toml, scheduled-d check-config," \
		"systemctl enable --now scheduled-d-all"

uninstall:
	@if $(LIVE) && [ "$$(id -u)" != 0 ]; then \
		echo "make uninstall: run it as root (or DESTDIR=... for a staged install)" >&2; \
		exit 1; \
	fi
	@# stop and disable our units (worker instances included) before their files go
	if $(LIVE) && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then \
		units="$$(systemctl list-units --all --plain --no-legend --type=service,timer \
			'scheduled-d-*' | awk '{print $$1}')"; \
		enabled="$$(find $(SYSTEMD_DIR) -path '*.wants/scheduled-d-*' \
			-printf '%f\n' 2>/dev/null | sort -u)"; \
		if [ -n "$$units$$enabled" ]; then \
			systemctl disable --now $$units $$enabled || true; \
		fi; \
	fi
	rm -f "$(DESTDIR)$(PREFIX)/bin/schedctl" "$(DESTDIR)$(PREFIX)/bin/scheduled-d"
	for page in $(MAN_PAGES); do rm -f "$(DESTDIR)$(MANDIR)/man$${page##*.}/$$page"; done
	for unit in $(UNIT_FILES); do rm -f "$(DESTDIR)$(SYSTEMD_DIR)/$$unit"; done
	@# only a venv that install made (a wrong INSTALL_VENV must not delete anything else)
	if [ -f "$(DESTDIR)$(INSTALL_VENV)/$(VENV_MARK)" ]; then \
		rm -rf "$(DESTDIR)$(INSTALL_VENV)"; \
	fi
	if $(LIVE) && command -v mandb >/dev/null 2>&1; then mandb -q || true; fi
	if $(LIVE) && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then \
		systemctl daemon-reload; \
	fi
	@echo "kept: $(SYSCONF) (configuration, jobs.d), $(STATE_DIR) (data) and the scheduled" \
		"user; remove them by hand: rm -r $(SYSCONF) $(STATE_DIR); userdel scheduled"

# ---------------------------------------------------------------------------------------
# onefile: dist/scheduled.pyz, schedctl and scheduled-d in one executable file (shiv: the
# dependencies are inside; on its first run it unpacks them, compiled parts included, to
# ~/.shiv or $$SHIV_ROOT). Needs only python3 (3.11, as the wheels inside are built for
# it) on the target. Rebuilt only when the sources or pyproject.toml changed. Dispatch:
# scheduled_d/onefile.py.

SHIV_VERSION := 1.0.8
SHIV_VENV := build/shiv-venv
ONEFILE := dist/scheduled.pyz
ONEFILE_SOURCES := pyproject.toml $(shell find schedctl daemon -type f \
	\( -name '*.py' -o -name '*.ini' -o -name '*.mako' -o -name '*.typed' \) \
	-not -path '*/__pycache__/*' 2>/dev/null)

.PHONY: onefile

onefile: $(ONEFILE)

$(SHIV_VENV)/bin/shiv:
	$(PYTHON) -m venv $(SHIV_VENV)
	$(SHIV_VENV)/bin/pip install -q --disable-pip-version-check shiv==$(SHIV_VERSION)

$(ONEFILE): $(ONEFILE_SOURCES) | $(SHIV_VENV)/bin/shiv
	mkdir -p $(dir $@)
	@# built next to the target and renamed: a reader never sees half a file
	$(SHIV_VENV)/bin/shiv --quiet --compile-pyc --reproducible \
		--python '/usr/bin/env python3' --entry-point scheduled_d.onefile:main \
		--output-file $@.tmp . --disable-pip-version-check
	mv -f $@.tmp $@
	@ls -l $@

# ---------------------------------------------------------------------------------------
# deb: dist/scheduled_VERSION_ARCH.deb (VERSION from pyproject.toml, or DEB_VERSION=), the
# install target's tree with PREFIX=/usr and the units in /lib/systemd/system, made into a
# Debian package by packaging/deb/build.sh: the venv in /opt/scheduled (built against
# /usr/bin/python3; Depends pins its minor version), /usr/bin/schedctl and scheduled-d, the
# man pages, the units (none enabled), /etc/scheduled/scheduled.toml as a conffile; the
# maintainer scripts in packaging/deb create the scheduled user, restart the running units
# one at a time on an upgrade, keep the data on remove and delete it on purge. The wheels
# come only from the wheelhouse (WHEELHOUSE, default ./wheelhouse): `make wheelhouse`
# fills it once per pyproject.toml change through pip's own configuration (the local wheel
# cache and indexes, else the package index), and from then on `make deb` builds offline
# (pip --no-index; tests/acceptance/test_deb.py builds it without a network).
# The package is always rebuilt from scratch: a minute or two. DEB_XZ_LEVEL (default 1) trades build time
# for size: 9 saves a few MB and takes minutes.

PROJECT_VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml | head -n 1)
DEB_VERSION ?= $(PROJECT_VERSION)
DEB_ARCH := $(shell dpkg --print-architecture 2>/dev/null || echo amd64)
DEB_MAINTAINER ?= schedctl maintainers <maintainers@schedctl.org>
DEB_XZ_LEVEL ?= 1
DEB_STAGE := build/deb
DEB_FILE ?= dist/scheduled_$(DEB_VERSION)_$(DEB_ARCH).deb
WHEELHOUSE ?= wheelhouse
WHEELHOUSE_STAMP := $(WHEELHOUSE)/.filled.stamp

.PHONY: deb wheelhouse

wheelhouse: $(WHEELHOUSE_STAMP)

# The dependencies' wheels for /usr/bin/python3 (the interpreter of the package's venv) and
# hatchling (`pip install .` builds the project with it); the project's own wheel is built
# by every `make deb` from the tree, so it is not kept here.
$(WHEELHOUSE_STAMP): pyproject.toml
	@if [ ! -x /usr/bin/python3 ]; then \
		echo "make wheelhouse: needs Debian's /usr/bin/python3" >&2; exit 1; \
	fi
	rm -rf build/wheelhouse-venv
	/usr/bin/python3 -m venv build/wheelhouse-venv
	mkdir -p $(WHEELHOUSE)
	build/wheelhouse-venv/bin/pip download -q --disable-pip-version-check \
		--dest $(WHEELHOUSE) hatchling
	build/wheelhouse-venv/bin/pip wheel -q --disable-pip-version-check \
		--wheel-dir $(WHEELHOUSE) .
	rm -f $(WHEELHOUSE)/schedctl-*.whl
	rm -rf build/wheelhouse-venv
	touch $@

deb: $(WHEELHOUSE_STAMP)
	@for tool in dpkg-deb dpkg-shlibdeps; do \
		command -v $$tool >/dev/null 2>&1 || { \
			echo "make deb: $$tool is missing: apt-get install dpkg-dev" >&2; exit 1; }; \
	done
	@if [ ! -x /usr/bin/python3 ]; then \
		echo "make deb: needs Debian's /usr/bin/python3 (the venv is built against it)" >&2; \
		exit 1; \
	fi
	rm -rf $(DEB_STAGE)
	@# offline: every wheel from the wheelhouse, no index asked
	PIP_NO_INDEX=1 PIP_FIND_LINKS=$(abspath $(WHEELHOUSE)) \
		$(MAKE) --no-print-directory install DESTDIR=$(CURDIR)/$(DEB_STAGE)/root PREFIX=/usr \
		SYSTEMD_DIR=/lib/systemd/system INSTALL_PYTHON=/usr/bin/python3 >/dev/null
	DEB_XZ_LEVEL=$(DEB_XZ_LEVEL) packaging/deb/build.sh $(DEB_STAGE)/root '$(DEB_VERSION)' $(DEB_ARCH) \
		'$(DEB_MAINTAINER)' $(DEB_FILE)
	rm -rf $(DEB_STAGE)
	@ls -l $(DEB_FILE)
