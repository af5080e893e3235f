# One entry point for a fresh machine: `make test` and `make demo` create .venv and install
# everything they need. torch is pinned and installed first so pip never pulls CUDA wheels.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: setup test test-all bench demo interop clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,qlora,data]'
	touch $@

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m ''

bench: setup
	$(PY) scripts/bench_cid.py
	$(PY) scripts/bench_net.py
	$(PY) scripts/bench_train.py
	$(PY) scripts/bench_aggregate.py --threads 1

interop: setup
	cd interop/helia && npm ci
	$(PY) -m pytest -q -m interop tests/interop

demo: setup
	$(VENV)/bin/infernet demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
