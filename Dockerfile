# syntax=docker/dockerfile:1
# Remote attention service image.
#
#   docker build -t remote-attention:0.1.0 .                     # GPU image (default target)
#   docker build --target loadtest -t remote-attention-loadtest .  # Locust load generator
#
# The GPU image uses NVIDIA's smallest CUDA image ("base": driver hooks + cudart only) because
# the torch wheel brings its own CUDA libraries; torch 2.13.0 from PyPI is built for CUDA 13,
# so the host driver must be R580 or newer. CPU-only image (no CUDA anywhere, much smaller):
#   docker build --build-arg BASE_IMAGE=ubuntu:24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t remote-attention:cpu .
# (docker-compose.cpu.yml does exactly this.)

ARG BASE_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04

# ---------------------------------------------------------------------------------------------
# builder: a virtualenv with torch, triton, the client and the service; copied whole into the
# runtime stage, so pip, its caches and build-time files never reach the final image.
FROM ${BASE_IMAGE} AS builder
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# The heavy layer first, so source edits do not re-download torch.
ARG TORCH_VERSION=2.13.0
ARG TRITON_VERSION=3.6.0
# Where torch comes from; the CPU image points this at the PyTorch CPU wheel index.
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && pip install --no-cache-dir "triton==${TRITON_VERSION}"

WORKDIR /src
# The client first: the server imports its generated protobuf stubs (attention_wire.pb).
COPY client/ client/
RUN pip install --no-cache-dir ./client
COPY pyproject.toml README.md ./
COPY kernels/ kernels/
COPY service/ service/
RUN pip install --no-cache-dir . \
 && python -c "import attention_kernels, attention_service, attention_wire.pb"

# ---------------------------------------------------------------------------------------------
# loadtest: Locust plus the client (no torch), for `docker compose --profile loadtest`.
FROM python:3.12.11-slim-bookworm AS loadtest
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1
COPY client/ /tmp/client/
RUN pip install --no-cache-dir "locust==2.47.0" "ml_dtypes==0.6.0" /tmp/client \
 && rm -rf /tmp/client \
 && useradd --create-home --uid 10001 locust
COPY loadtest/locustfile.py /home/locust/locustfile.py
USER 10001:10001
WORKDIR /home/locust
# Options come from LOCUST_* (headless, users, run time, csv) and LOADTEST_* (shapes) variables.
ENTRYPOINT ["locust", "-f", "/home/locust/locustfile.py"]

# ---------------------------------------------------------------------------------------------
# runtime (the default target): the service.
FROM ${BASE_IMAGE} AS runtime
ARG TORCH_VERSION=2.13.0
ARG TRITON_VERSION=3.6.0
LABEL org.opencontainers.image.title="remote-attention" \
      org.opencontainers.image.description="gRPC attention service: Triton varlen flash-attention prefill and split-K decode" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.remote-attention.torch="${TORCH_VERSION}" \
      io.remote-attention.triton="${TRITON_VERSION}"
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small C launcher per kernel signature at run time (warm-up, first calls):
# it needs a C compiler, libc headers and Python.h in the final image, not only in a builder.
# tini is PID 1 so SIGTERM reaches the server and it drains in-flight calls (--grace-seconds).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev tini \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --shell /usr/sbin/nologin attention \
 && mkdir -p /home/attention/.triton/cache \
 && chown -R attention:attention /home/attention/.triton

COPY --from=builder /opt/venv /opt/venv
COPY deploy/healthcheck.py /opt/attention/healthcheck.py

# Configuration is the ATTENTION_* variables of docs/CONTRACTS.md; these match EXPOSE (and
# /metrics listens on all interfaces here, for Prometheus over the compose network).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    CC=gcc \
    TRITON_CACHE_DIR=/home/attention/.triton/cache \
    ATTENTION_HOST=0.0.0.0 \
    ATTENTION_PORT=50051 \
    ATTENTION_METRICS_PORT=8000 \
    ATTENTION_METRICS_HOST=0.0.0.0

USER 10001:10001
WORKDIR /home/attention
# gRPC, Prometheus /metrics
EXPOSE 50051 8000

# The server reports SERVING only once warm-up (Triton compilation) is done: allow for it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --start-interval=5s --retries=3 \
    CMD ["python", "/opt/attention/healthcheck.py"]

ENTRYPOINT ["tini", "--", "attention-server"]
