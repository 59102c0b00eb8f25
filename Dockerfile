# kvblend service image.
#   CPU (default):  docker build -t kvblend .
#   CUDA:           docker build -t kvblend:cuda \
#                     --build-arg BASE=nvidia/cuda:13.0.0-runtime-ubuntu24.04 --build-arg EXTRAS=gpu .
# Run (see README, "Running on a GPU host"): --ipc=host for CUDA IPC or --shm-size for the cache,
# and --stop-timeout 90, since Docker's default 10 s would kill a data plane that is draining:
#   docker run --rm --ipc=host --stop-timeout 90 -p 127.0.0.1:8780:8780 -e KVBLEND_API_TOKEN kvblend
# The image binds 0.0.0.0: kvblend serve refuses to start there without an API token.
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG EXTRAS=""
# The runtime user's uid: the data plane serves only clients of its own uid (SO_PEERCRED), so
# engines run as this uid too (docker run --user 10001), or build with theirs.
ARG KVBLEND_UID=10001
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    NUMBA_CACHE_DIR=/var/cache/kvblend/numba \
    KVBLEND_HOST=0.0.0.0

# CUDA base images carry no Python; the slim Python image already has it. The packages come from
# whichever distribution the base image is: their versions are the base image's to pin.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && \
        rm -rf /var/lib/apt/lists/*; \
    fi && python3 -m venv /opt/kvblend && \
    groupadd --system --gid "$KVBLEND_UID" kvblend && \
    useradd --system --uid "$KVBLEND_UID" --gid kvblend --create-home --home-dir /home/kvblend \
        --shell /usr/sbin/nologin kvblend && \
    mkdir -p "$NUMBA_CACHE_DIR" && chown kvblend:kvblend "$NUMBA_CACHE_DIR"
ENV PATH=/opt/kvblend/bin:$PATH

WORKDIR /src
# Dependencies first, from pyproject.toml alone, so that editing the source reuses this layer
# (torch is most of the image). Without the gpu extra take torch's CPU build first (the default
# wheel pulls several GB of CUDA); the list's own torch requirement is then already met.
# The versions are pyproject.toml's ranges.
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN python3 -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
extras = [e for e in sys.argv[1].split(",") if e]; \
print("\n".join(p["dependencies"] + [d for e in extras for d in p["optional-dependencies"][e]]))' \
        "$EXTRAS" > /tmp/requirements.txt && \
    if [ -z "$EXTRAS" ]; then \
        pip install torch --index-url https://download.pytorch.org/whl/cpu ; \
    fi && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt

COPY README.md setup.py kvblend-legacy.pth ./
COPY shm/ shm/
COPY dataplane/ dataplane/
COPY api/ api/
COPY engine/ engine/
RUN pip install --no-deps .

# Run as an unprivileged user, from a folder without sources: `python -m kvblend.dataplane` and
# `python -m uvicorn` put the working directory first on sys.path, and must import the installed
# package, whose files the numba cache below is keyed by.
USER ${KVBLEND_UID}:${KVBLEND_UID}
WORKDIR /home/kvblend

# Compile every kernel the service warms at start-up (the data plane's warm-up, which covers the
# API's) into numba's cache, so the container's first start loads them instead of compiling.
# numba keys its cache by CPU model and features as well: on another CPU the service compiles
# once at its first start (before /readyz turns 200) and adds to this cache, which the runtime
# user owns.
RUN python3 -c "from kvblend.dataplane import kernels; kernels.warm('kvblend')"

EXPOSE 8780
# Stopping drains: the API finishes its requests, then the data plane its queued copies (up to
# --stop-grace-s, 60 s by default, plus the API's quarter). Docker's stop timeout cannot be set
# here: give `docker run --stop-timeout 90` (compose: stop_grace_period) or it kills at 10 s.
STOPSIGNAL SIGTERM
# Readiness, not liveness: /readyz answers 200 once the data plane answers (open without a token).
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('KVBLEND_PORT', '8780'), timeout=2)"]
ENTRYPOINT ["kvblend"]
CMD ["serve"]
