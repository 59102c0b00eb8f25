# kvblend service image.
#   CPU (default):  docker build -t kvblend .
#   CUDA:           docker build -t kvblend:cuda --build-arg EXTRAS=gpu .
# One base for both: the CUDA image's CUDA libraries are the pip wheels that torch's CUDA build
# and cupy-cuda13x[ctk] bring (one copy, torch's pinned cuda-toolkit); the GPU driver comes from the
# host (--gpus all). A CUDA base image would add a second CUDA stack next to them.
# Run (see README, "Running on a GPU host"): --ipc=host for CUDA IPC or --shm-size for the cache,
# and --stop-timeout 90, since Docker's default 10 s would kill a data plane that is draining:
#   docker run --rm --ipc=host --stop-timeout 90 -p 127.0.0.1:8780:8780 -e KVBLEND_API_TOKEN kvblend
# The image binds 0.0.0.0: kvblend serve refuses to start there without an API token (or a
# KVBLEND_API_TOKEN_FILE, as a Docker secret gives: deploy/compose.yaml).
# The base is pinned by tag and digest (the tag says which, the digest is what is pulled).
ARG BASE=python:3.11.13-slim-bookworm@sha256:86adf8dbadc3d6e82ee5dd2c74bec2e1c2467cdad47886280501df722372d2e1
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

# A BASE without Python (another distribution's image) gets its python3; the default has one.
# libibverbs1: peer reads' transfer engine (the `peer` extra, below) loads it even for TCP, and
# uses it for RDMA where the host passes its devices in.
# The packages come from whichever distribution the base image is: their versions are its to pin.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 && \
    if ! command -v python3 >/dev/null 2>&1; then \
        apt-get install -y --no-install-recommends python3 python3-venv; \
    fi && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/kvblend && \
    groupadd --system --gid "$KVBLEND_UID" kvblend && \
    useradd --system --uid "$KVBLEND_UID" --gid kvblend --create-home --home-dir /home/kvblend \
        --shell /usr/sbin/nologin kvblend && \
    mkdir -p "$NUMBA_CACHE_DIR" && chown kvblend:kvblend "$NUMBA_CACHE_DIR"
ENV PATH=/opt/kvblend/bin:$PATH

WORKDIR /src
# Dependencies first, from pyproject.toml and constraints.txt alone, so that editing the source
# reuses this layer (torch is most of the image). torch first, the version of constraints.txt:
# the CPU build without the gpu extra (scripts/install_torch.py never takes the CUDA one then),
# PyPI's CUDA build with it; the list's own torch requirement is then already met. The other
# versions are pyproject.toml's ranges, under the same constraints. The `peer` extra (the remote
# tier's redis client and peer reads' transfer engine) is in every image, whatever EXTRAS adds.
COPY pyproject.toml constraints.txt ./
COPY scripts/install_torch.py scripts/
# hadolint ignore=DL3013
RUN python3 -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
extras = [e for e in sys.argv[1].split(",") if e]; \
print("\n".join(p["dependencies"] + [d for e in extras for d in p["optional-dependencies"][e]]))' \
        "peer,$EXTRAS" > /tmp/requirements.txt && \
    case ",$EXTRAS," in *,gpu,*) build=cuda ;; *) build=cpu ;; esac && \
    python3 scripts/install_torch.py --build "$build" --constraints constraints.txt && \
    pip install -c constraints.txt -r /tmp/requirements.txt && rm /tmp/requirements.txt

COPY README.md setup.py kvblend-legacy.pth ./
COPY shm/ shm/
COPY dataplane/ dataplane/
COPY api/ api/
COPY engine/ engine/
RUN pip install --no-deps .
# compose's shm-check service: does /dev/shm hold what kvblend serve creates there?
COPY scripts/shm_check.py /opt/kvblend/shm_check.py

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
