# make run   - install into .venv and serve the bundled demo models on http://127.0.0.1:8000
# make test  - install test dependencies and run the whole suite (slow end-to-end tests included)
# Other targets: test-fast, bench, bench-peers, bench-deps, load, demo-model, train-safety, eval-safety, gpu-smoke, help.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
ARGS   ?=

.PHONY: help run test test-fast bench bench-peers bench-deps load demo-model train-safety eval-safety gpu-smoke browser clean

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

test: $(VENV)/.installed-dev browser
	$(PY) -m pytest -q -ra $(ARGS)

test-fast: $(VENV)/.installed-dev
	$(PY) -m pytest -q -m "not slow" $(ARGS)

bench: $(VENV)/.installed-dev
	$(PY) -m bench.bench_engine $(ARGS)
	$(PY) -m bench.bench_families $(findstring --quick,$(ARGS))
	$(PY) -m bench.bench_peers

# The engine against llama.cpp (from bench-deps, when built) and transformers at 30M and 390M.
bench-peers: $(VENV)/.installed-dev
	$(PY) -m bench.bench_peers $(ARGS)

# Bench-only: the gguf package, and llama.cpp (llama-cpp-python from PyPI, compiled: 15-30 minutes
# on 2 cores, at nice 19) twice: for this CPU, and for AVX2 + FMA only (the AVX2 peer on AVX-512
# machines). Into build/llama-cpp/, not the venv, so both builds can be measured in one run.
# Never part of make test.
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36 diskcache==5.6.3
LLAMA_CPP_FLAGS_native := -DGGML_NATIVE=ON
LLAMA_CPP_FLAGS_avx2 := -DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
bench-deps: $(VENV)/.installed-dev build/llama-cpp/native/.built build/llama-cpp/avx2/.built
	$(PIP) install --quiet -r requirements-bench.txt

build/llama-cpp/%/.built: | $(VENV)/.installed-dev
	rm -rf $(@D) && mkdir -p $(@D)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF $(LLAMA_CPP_FLAGS_$*)" CMAKE_BUILD_PARALLEL_LEVEL=2 nice -n 19 \
	  $(PIP) install --quiet --no-cache-dir --no-deps --target $(@D) $(LLAMA_CPP_PYTHON)
	touch $@

load: $(VENV)/.installed-dev
	$(PY) -m bench.load $(ARGS)

# Rebuilds the training data (Debian's WordNet and fortunes), the tokenizer and both demo models.
demo-model: $(VENV)/.installed-dev
	@dpkg -s wordnet-base fortunes fortunes-min >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends wordnet-base fortunes fortunes-min >/dev/null; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq --no-install-recommends wordnet-base fortunes fortunes-min >/dev/null; fi; }
	nice -n 10 $(PY) -m scripts.demo_model.build --out models --jobs 2 $(ARGS)

train-safety: $(VENV)/.installed-dev
	$(PY) -m scripts.train_safety $(ARGS)

eval-safety: $(VENV)/.installed-dev
	$(PY) -m scripts.eval_safety $(ARGS)

# On a GPU host with TensorRT-LLM installed in its own environment (see docs/trtllm.md):
#   make gpu-smoke MODEL=/path/to/hf-model [SMOKE_ARGS="--tensor-parallel-size 2"] [TRT_PYTHON=python]
TRT_PYTHON ?= python
gpu-smoke:
	$(TRT_PYTHON) scripts/gpu_smoke.py $(MODEL) $(SMOKE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache artifacts
