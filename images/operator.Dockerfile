# syntax=docker/dockerfile:1.7
# The operator image: Python + kopf + the kubernetes client + tgspec/tg_operator.
# No torch, no Ray, no megatron (the operator talks to Ray over HTTP only).
#
#   docker build -f images/operator.Dockerfile -t ghcr.io/trainergroup/operator:0.1.0 .
#   (or `make images`; the build context is the repository root)
#
# Dependencies come from a hash-checked lock (images/requirements-operator.txt, `make
# images-lock`); our own package is installed without dependencies on top of it.

FROM python:3.12.12-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
COPY images/requirements-operator.txt /tmp/requirements-operator.txt
RUN /opt/venv/bin/pip install --no-cache-dir --require-hashes -r /tmp/requirements-operator.txt
WORKDIR /src
COPY pyproject.toml ./
COPY spec/ spec/
COPY operator/ operator/
COPY runtime/ runtime/
# --no-deps: every dependency is already in the venv from the lock; nothing unpinned sneaks in.
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation . \
 && /opt/venv/bin/python -c "import tg_operator, tgspec, kopf" \
 && ! /opt/venv/bin/python -c "import torch" 2>/dev/null \
 && ! /opt/venv/bin/python -c "import ray" 2>/dev/null

FROM python:3.12.12-slim-bookworm
LABEL org.opencontainers.image.title="trainergroup-operator" \
      org.opencontainers.image.description="kopf operator: TrainerGroup -> KubeRay RayCluster + detached Megatron workers" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 trainergroup \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin trainergroup
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TMPDIR=/tmp
# Numeric user so the kubelet can verify runAsNonRoot without reading /etc/passwd.
USER 10001:10001
WORKDIR /tmp
# 8080: kopf liveness (/healthz); 9090: Prometheus metrics (/metrics). docs/contracts.md.
EXPOSE 8080 9090
ENTRYPOINT ["tg-operator"]
