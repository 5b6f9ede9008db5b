# gpuguard: `make run` starts the exporter on this host; `make test` runs the whole suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test lint demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/gpuguard-exporter $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check gpuguard/*.py gpuguard/host gpuguard/orphans gpuguard/web gpuguard/launch gpuguard/console exporter remediator alerts grafana tests benchmarks deploy
	$(VENV)/bin/mypy
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m tests.support.demo

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
