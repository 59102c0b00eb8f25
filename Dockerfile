# kvblend service image.
#   CPU (default):  docker build -t kvblend .
#   CUDA:           docker build -t kvblend:cuda \
#                     --build-arg BASE=nvidia/cuda:13.0.0-runtime-ubuntu24.04 --build-arg EXTRAS=gpu .
# Run (see README: --ipc=host for CUDA IPC, a large /dev/shm for the cache):
#   docker run --rm --ipc=host -p 127.0.0.1:8780:8780 -e KVBLEND_API_TOKEN kvblend serve
# (the image binds 0.0.0.0: kvblend serve refuses to start there without an API token)
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG EXTRAS=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    NUMBA_CACHE_DIR=/var/cache/kvblend/numba \
    KVBLEND_HOST=0.0.0.0

# CUDA base images carry no Python; the slim Python image already has it.
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && \
        rm -rf /var/lib/apt/lists/*; \
    fi && python3 -m venv /opt/kvblend
ENV PATH=/opt/kvblend/bin:$PATH

WORKDIR /app
COPY pyproject.toml README.md ./
COPY shm/ shm/
COPY dataplane/ dataplane/
COPY api/ api/
# Without the gpu extra take torch's CPU build (the default wheel pulls several GB of CUDA).
RUN if [ -z "$EXTRAS" ]; then \
        pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install . ; \
    else \
        pip install ".[$EXTRAS]" ; \
    fi && mkdir -p "$NUMBA_CACHE_DIR"

EXPOSE 8780
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD python3 -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KVBLEND_PORT', '8780'), timeout=2)"
ENTRYPOINT ["kvblend"]
CMD ["serve"]
