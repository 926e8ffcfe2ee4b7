# make run   - install into .venv and serve the bundled demo models on http://127.0.0.1:8000
# make test  - install test dependencies and run the whole suite (slow end-to-end tests included)
# Other targets: lint, test-fast, bench, bench-peers, bench-deps, load, demo-model, train-safety, eval-safety, cuda-check, gpu-smoke, browser, clean, help.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
ARGS   ?=

.PHONY: help run lint test test-fast bench bench-peers bench-deps load demo-model train-safety eval-safety cuda-check gpu-smoke browser clean

help:
	@sed -n '1,3p' Makefile

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet -r requirements.txt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PIP) install --quiet -r requirements-dev.txt
	touch $@

run: $(VENV)/.installed
	$(PY) server.py $(ARGS)

# Debian's Chromium for the browser tests (Playwright drives it; browser downloads are not used).
browser:
	@test -x /usr/bin/chromium || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null; fi; }

# ruff (lint and format check) over the tree, mypy over the server's packages (pyproject.toml).
# CI (.ci/run) runs it before the tests; `ruff format .` and `ruff check --fix .` fix most findings.
lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: $(VENV)/.installed-dev browser
	$(PY) -m pytest -q -ra $(ARGS)

test-fast: $(VENV)/.installed-dev
	$(PY) -m pytest -q -m "not slow" $(ARGS)

bench: $(VENV)/.installed-dev
	$(PY) -m bench.bench_engine $(ARGS)
	$(PY) -m bench.bench_families $(findstring --quick,$(ARGS))
	$(PY) -m bench.bench_qwen3_5
	$(PY) -m bench.bench_safety
	$(PY) -m bench.bench_structured
	$(PY) -m bench.bench_peers
	$(PY) -m bench.bench_amx

# The engine against llama.cpp (from bench-deps, when built) and transformers at 30M and 390M.
bench-peers: $(VENV)/.installed-dev
	$(PY) -m bench.bench_peers $(ARGS)

# Bench-only: llama.cpp from llama-cpp-python's PyPI source package (the gguf package that writes
# its files is a runtime dependency, for server.py import-gguf), built
# twice: for this CPU, and for AVX2 + FMA only (the AVX2 peer on AVX-512 machines). Only the
# library the Python bindings load is compiled (about 5-10 minutes each on 2 cores, at nice 19),
# into build/llama-cpp/<build>/ rather than the venv, so both builds can be measured in one run.
# Never part of make test.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP_SRC := build/llama-cpp/llama_cpp_python-$(LLAMA_CPP_VERSION)
LLAMA_CPP_FLAGS_native := -DGGML_NATIVE=ON
LLAMA_CPP_FLAGS_avx2 := -DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
LLAMA_CPP_ONLY_LIB := -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF
bench-deps: $(VENV)/.installed-dev build/llama-cpp/native/.built build/llama-cpp/avx2/.built

$(LLAMA_CPP_SRC)/.unpacked: | $(VENV)/.installed-dev
	@command -v cmake >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq cmake >/dev/null; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq cmake >/dev/null; fi; }
	mkdir -p build/llama-cpp
	$(PIP) download --quiet --no-deps --no-binary :all: -d build/llama-cpp llama-cpp-python==$(LLAMA_CPP_VERSION)
	tar -xzf build/llama-cpp/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C build/llama-cpp
	touch $@

build/llama-cpp/%/.built: $(LLAMA_CPP_SRC)/.unpacked
	rm -rf $(@D) build/llama-cpp/cmake-$*
	cmake -S $(LLAMA_CPP_SRC)/vendor/llama.cpp -B build/llama-cpp/cmake-$* -DCMAKE_BUILD_TYPE=Release \
	  -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_RPATH='$$ORIGIN' $(LLAMA_CPP_FLAGS_$*) $(LLAMA_CPP_ONLY_LIB) >/dev/null
	nice -n 19 cmake --build build/llama-cpp/cmake-$* --target llama -j 2
	mkdir -p $(@D)/llama_cpp/lib
	cp -r $(LLAMA_CPP_SRC)/llama_cpp/. $(@D)/llama_cpp/
	cp -a build/llama-cpp/cmake-$*/bin/*.so* $(@D)/llama_cpp/lib/
	$(PIP) install --quiet --no-deps --target $(@D) diskcache==5.6.3
	touch $@

load: $(VENV)/.installed-dev
	$(PY) -m bench.load $(ARGS)

# Rebuilds the training data (Debian's WordNet and fortunes, wordfreq's word list), the tokenizer
# and both demo models (resuming from checkpoints in build/demo_model unless ARGS=--fresh), their
# cards, and safety/demo_answers.jsonl (their answers, for make eval-safety).
demo-model: $(VENV)/.installed-dev
	@dpkg -s wordnet-base fortunes fortunes-min >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends wordnet-base fortunes fortunes-min >/dev/null; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq --no-install-recommends wordnet-base fortunes fortunes-min >/dev/null; fi; }
	nice -n 10 $(PY) -m scripts.demo_model.build --out models --jobs 2 $(ARGS)
	nice -n 10 $(PY) -m scripts.demo_answers

train-safety: $(VENV)/.installed-dev
	$(PY) -m scripts.train_safety $(ARGS)

eval-safety: $(VENV)/.installed-dev
	$(PY) -m scripts.eval_safety $(ARGS)

# On an NVIDIA GPU host (a CUDA build of torch in the venv): the engine tests with the engine on
# CUDA, then the benches against transformers on the same GPU; logs in artifacts/cuda.
cuda-check: $(VENV)/.installed-dev
	PY=$(PY) bash scripts/cuda_check.sh

# On a GPU host with TensorRT-LLM installed in its own environment (see docs/trtllm.md):
#   make gpu-smoke MODEL=/path/to/hf-model [SMOKE_ARGS="--tensor-parallel-size 2"] [TRT_PYTHON=python]
TRT_PYTHON ?= python
gpu-smoke:
	$(TRT_PYTHON) scripts/gpu_smoke.py $(MODEL) $(SMOKE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache artifacts
