# Two entry points: `make demo` runs otelgpu on its embedded demo cluster, `make test` runs the tests.
# Both create the virtual environment in .venv on first use.
PY ?= python3
VENV := .venv

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

.PHONY: demo test bench
demo: $(VENV)/.installed
	$(VENV)/bin/otelgpu demo

test: $(VENV)/.installed
	tools/ensure-prometheus
	tools/ensure-gcc
	tools/focus-validate --install
	$(VENV)/bin/python -m pytest -n auto

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/bench_pipeline.py
