# Two commands set everything up on a fresh machine:
#   make serve   install, then start the service on its defaults
#   make test    install, then run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
export NUMBA_CACHE_DIR ?= $(CURDIR)/.cache/numba

.PHONY: install serve test bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Without an NVIDIA GPU take the CPU build of torch (an unpinned torch pulls a CUDA build of several GB).
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/kvblend serve

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .cache
