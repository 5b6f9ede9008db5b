# gpuguard: `make run` starts the exporter on this host; `make test` runs the whole suite.
#
# Two installs in one venv: `make run` installs gpuguard and its run-time dependencies only;
# `make test` (and demo, bench) adds the test, docs and mcp extras. Both install the tested
# versions (constraints.txt).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet -c constraints.txt
RUN_STAMP := $(VENV)/.installed-run
STAMP  := $(VENV)/.installed

.PHONY: run test lint demo bench compat mixin dist clean smoke

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

$(RUN_STAMP): pyproject.toml constraints.txt | $(VENV)/bin/python
	$(PIP) -e .
	touch $(RUN_STAMP)

$(STAMP): pyproject.toml constraints.txt | $(VENV)/bin/python
	$(PIP) -e '.[test,docs,mcp]'
	touch $(STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/gpuguard-exporter $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check build_backend gpuguard/*.py gpuguard/base gpuguard/engine gpuguard/host gpuguard/gpu gpuguard/orphans gpuguard/web gpuguard/launch gpuguard/console gpuguard/config gpuguard/exporter gpuguard/remediator alerts grafana tests benchmarks deploy
	$(VENV)/bin/mypy
	$(PY) -m pytest $(PYTEST_ARGS)

# The pure, live-process and synthetic Windows tests on another Python, in a venv of its own (.venv-pyX.Y):
#   make compat COMPAT_PYTHON=/root/.pyenv/versions/3.10.13/bin/python3
# (.ci/run does this for 3.10 and 3.13; the whole suite runs on the default python3.)
COMPAT_PYTHON ?=
ifneq ($(COMPAT_PYTHON),)
COMPAT_VENV := .venv-py$(shell $(COMPAT_PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
endif
compat:
	@[ -n "$(COMPAT_PYTHON)" ] || { echo "make compat: COMPAT_PYTHON=/path/to/python3.X is missing" >&2; exit 2; }
	[ -x $(COMPAT_VENV)/bin/python ] || $(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet -c constraints.txt --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[test,mcp]'
	$(COMPAT_VENV)/bin/python -m pytest tests/pure tests/live tests/windows/synthetic $(PYTEST_ARGS)

# The rules, recording rules and dashboard from mixin/ (then the Kubernetes manifests
# that embed them); tests/deploy/test_mixin.py fails while a checked-in file differs.
mixin: $(STAMP)
	$(PY) -m gpuguard.monitoring_mixin
	$(PY) deploy/kubernetes/generate.py

# On a host with a real NVIDIA GPU only (never in CI): what the driver answers to each
# NVML call gpuguard makes, gpuguard's own read, and one scrape of a real exporter.
smoke: $(RUN_STAMP)
	$(PY) tests/device/nvml_smoke.py

demo: $(STAMP)
	$(PY) -m tests.support.demo

bench: $(STAMP)
	$(PIP) -e '.[test,docs,mcp,bench]'
	$(PY) benchmarks/run_all.py

# The release files: sdist, wheel (built from the sdist) and SHA256SUMS, in dist/. The
# version is CHANGELOG.md's newest release (build_backend/gpuguard_release.py): X.Y.Z on the
# commit that wrote its heading, X.Y.Z.post1.devN+gHASH after it; tags not needed. No
# build isolation: the venv has the backend and its plugin, at the tested versions
# (constraints.txt).
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .
	cd dist && sha256sum gpuguard-*.tar.gz gpuguard-*.whl > SHA256SUMS
	cat dist/SHA256SUMS

clean:
	rm -rf $(VENV) .venv-py* .pytest_cache .ruff_cache *.egg-info dist build
