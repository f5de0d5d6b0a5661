# Two entry points: `make demo` runs otelgpu on its embedded demo cluster, `make test` runs the tests.
# Both create the virtual environment in .venv on first use.
PY ?= python3
VENV := .venv

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

# `make test` builds the OpenTelemetry Collector the end-to-end tests run (tools/ensure-otelcol:
# about five minutes the first time on a fresh machine, reused from a cache outside the tree after).
.PHONY: demo demo-collector test bench otelcol
demo: $(VENV)/.installed
	$(VENV)/bin/otelgpu demo

# otelgpu between a real Collector and a real Prometheus, on loopback (tools/demo_collector.py)
demo-collector: $(VENV)/.installed
	tools/ensure-prometheus
	tools/ensure-otelcol >/dev/null
	$(VENV)/bin/python tools/demo_collector.py

test: $(VENV)/.installed
	tools/ensure-prometheus
	tools/ensure-gcc
	tools/focus-validate --install
	tools/ensure-otelcol >/dev/null
	$(VENV)/bin/python -m pytest -n auto

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/bench_pipeline.py

otelcol:
	tools/ensure-otelcol
