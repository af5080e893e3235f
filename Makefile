# One entry point for a fresh machine: `make test` and `make demo` create .venv and install
# everything they need. torch is pinned and installed first so pip never pulls CUDA wheels.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

LLAMA_CPP_PYTHON ?= 0.3.36

.PHONY: setup test test-all bench demo interop pipeline clean ui-check

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	bash scripts/install_venv.sh $(VENV) '$(TORCH)' '.[dev,qlora,data,hf,viz]'  # uv, or pip when uv fails
	touch $@

# Two test processes (pytest-xdist): most tests wait on real agents' timers, not on the CPU, so two at
# once take about half the wall time on 2 cores. A short --basetemp: agent homes hold Unix sockets,
# whose paths must stay under 108 bytes.
PYTEST := $(PY) -m pytest -q -n 2 --basetemp=$$(mktemp -d /tmp/inft-XXXXXX)

test: setup
	$(PYTEST)

# The web page (`infernet ui`) in a real headless Chromium against a demo network; the screenshot stays in
# ui-check/. Installs Debian's chromium when run as root and it is missing; without one the test warns, saying so.
# (The UI is checked on the network of the CLI job test, once its job is DONE.)
ui-check: setup
	@command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || apt-get install -y -q chromium >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) || true
	mkdir -p ui-check
	INFERNET_UI_SHOTS=$(CURDIR)/ui-check $(PY) -m pytest -q -rs -p no:cacheprovider tests/cli/test_ui.py \
		tests/cli/test_job_flow.py::test_job_announce_watch_fetch_between_agent_processes

test-all: setup
	$(PYTEST) -m ''

bench: setup
	$(PY) scripts/bench_cid.py
	$(PY) scripts/bench_net.py
	$(PY) scripts/bench_train.py
	$(PY) scripts/bench_ledger.py
	$(PY) scripts/bench_aggregate.py --threads 1

interop: setup
	cd interop/helia && npm ci
	$(PY) -m pytest -q -m interop tests/interop

# GGUF export (`infernet publish --gguf`): llama-cpp-python, compiled from its sdist (about 6 min on
# 2 cores), and llama.cpp's own converter (convert_hf_to_gguf.py, conversion/, gguf-py/) copied
# from the same sdist into $(VENV)/share/llama.cpp, where `infernet publish` looks for it. Then its
# tests, and scripts/pipeline_demo.py: a topic website on loopback -> `train data` -> a job on a
# loopback network -> `publish` (merged, GGUF, Ollama) -> text from the GGUF (about 2 min).
pipeline: $(VENV)/.llama-cpp-$(LLAMA_CPP_PYTHON)-portable
	$(PY) -m pytest -q -m 'llama_cpp and not slow' tests/pipeline
	$(PY) scripts/pipeline_demo.py

# Built portable (GGML_NATIVE=OFF: AVX2/FMA/F16C, no -march=native): a native build on a VM whose CPU
# flags advertise AVX-512 and AMX it does not enable died with "Illegal instruction" (issue 25).
$(VENV)/.llama-cpp-$(LLAMA_CPP_PYTHON)-portable: $(VENV)/.installed
	mkdir -p build/llama-cpp
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: -d build/llama-cpp \
		llama-cpp-python==$(LLAMA_CPP_PYTHON)
	rm -rf build/llama-cpp/src && mkdir -p build/llama-cpp/src
	tar xzf build/llama-cpp/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C build/llama-cpp/src --strip-components=1
	rm -rf $(VENV)/share/llama.cpp && mkdir -p $(VENV)/share/llama.cpp
	cp -r build/llama-cpp/src/vendor/llama.cpp/convert_hf_to_gguf.py build/llama-cpp/src/vendor/llama.cpp/conversion \
		build/llama-cpp/src/vendor/llama.cpp/gguf-py $(VENV)/share/llama.cpp/
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(PY) -m pip install -q --disable-pip-version-check --no-cache-dir \
		--force-reinstall --no-deps build/llama-cpp/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz
	$(PY) -m pip install -q --disable-pip-version-check -e '.[gguf]'
	touch $@

demo: setup
	$(VENV)/bin/infernet demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
