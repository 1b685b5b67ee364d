# topodra: `make demo` runs the mock-GPU demo on a real local cluster; `make test` runs everything CI runs.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: kind-test kind-smoke venv deps lint typecheck unit test demo demo-down bins proto clean fresh-check image helm-lint

# System packages first: a fresh Debian 12 has no python3-venv, so `make venv` alone would fail there.
deps:
	hack/install-deps

# topodra itself, then the development-only distribution of hack/pyproject.toml: the test kit
# (hack/testkit), hack/images and bench/ as importable packages. The runtime image never ships the latter.
$(VENV)/.installed: pyproject.toml hack/pyproject.toml | deps
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	$(VENV)/bin/pip install -q -e hack
	touch $@

venv: $(VENV)/.installed

bins: deps
	hack/build-bins >/dev/null

lint: venv
	$(VENV)/bin/ruff check $(wildcard driver tests hack bench)
	$(VENV)/bin/lint-imports --no-cache --no-logo  # the layer contract in pyproject.toml

typecheck: venv
	$(VENV)/bin/mypy driver/topodra
	$(VENV)/bin/mypy tests hack bench

# The unit tier: no root, no cluster, no Kubernetes binaries (tests/unit/<layer>/).
unit: venv
	$(VENV)/bin/pytest -q -ra tests/unit

# The loopback-cluster suite, then the whole kind suite (real kind nodes with the Helm chart; the first run
# builds the offline node image, ~16 min cold, cached after). TOPODRA_SKIP_KIND=1 skips the kind part locally
# and says so last; CI (CI=true) refuses to skip it.
test: venv bins lint typecheck
	@if [ "$${TOPODRA_SKIP_KIND:-0}" = 1 ] && [ "$${CI:-}" = true ]; then \
		echo "make test: CI=true runs the kind suite; unset TOPODRA_SKIP_KIND" >&2; exit 2; fi
	$(VENV)/bin/pytest -q -ra --durations=15 tests
	@if [ "$${TOPODRA_SKIP_KIND:-0}" = 1 ]; then echo "kind suite SKIPPED (TOPODRA_SKIP_KIND=1): tests/kind did not run"; \
	else $(MAKE) --no-print-directory kind-test; fi

# topodra on a real kind cluster with mock GPUs (tests/kind; hack/kind-up), deleted again afterwards. Starts a
# private dockerd when no container engine works (hack/dockerd) and builds the offline node image on first
# use (hack/kind-image). kind-test (every kind test, one cluster for all) runs at the end of `make test`;
# kind-smoke (one node, the tests marked smoke) is the quick local check.
kind-test: venv bins
	$(VENV)/bin/pytest -q -ra --durations=15 tests/kind

kind-smoke: venv bins
	TOPODRA_KIND_TOPOLOGY=single $(VENV)/bin/pytest -q -ra --durations=15 -m smoke tests/kind

demo: venv bins
	hack/demo

demo-down:
	hack/demo down

proto: venv
	hack/gen-proto

# The README's setup path in a clean clone with empty HOME/Go caches/binary cache (cold build: ~15 min).
fresh-check:
	hack/fresh-machine-check
