# The operator image: Python + kopf + the kubernetes client + tgapi/tg_operator.
# No torch, no Ray, no megatron (the operator talks to Ray over HTTP only).
#
#   DOCKER_BUILDKIT=1 docker build -f images/operator.Dockerfile -t ghcr.io/trainergroup/operator:0.1.0 .
#   (or `make images`; the build context is the repository root)
#
# Here (no image registry reachable) `hack/images/build.sh operator` builds it FROM a stand-in
# base made from Debian's packages (--build-arg BASE_IMAGE=..., hack/images/build-bases.sh) and
# hands pip the host's CA bundle as a BuildKit secret: `--secret id=pip-ca,src=FILE`. The secret
# is mounted only during the RUN that installs the lock; nothing of it stays in any layer.
# No `# syntax=` line: the Dockerfile frontend built into the engine's BuildKit is used, so
# nothing is pulled (RUN --mount needs Docker >= 20.10 with DOCKER_BUILDKIT=1).
#
# Dependencies come from a hash-checked lock (images/requirements-operator.txt, `make
# images-lock`; universal, Python >= 3.12); our own package is installed without
# dependencies on top of it.

# Production base; a build argument so it can be swapped for a locally built stand-in.
ARG BASE_IMAGE=python:3.12.12-slim-bookworm

FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
COPY images/requirements-operator.txt /tmp/requirements-operator.txt
# The wheels live in a BuildKit cache mount (kept across builds, never in the image): `pip
# download -d` fetches only the files not there yet (hash-checked), then pip installs offline
# from that folder. (pip's HTTP cache is not enough: a proxy without caching headers defeats it.)
RUN --mount=type=cache,id=trainergroup-pip-operator,target=/root/.cache/pip \
    --mount=type=secret,id=pip-ca,required=false \
    if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && /opt/venv/bin/pip download --require-hashes -r /tmp/requirements-operator.txt -d /root/.cache/pip/wheels \
 && /opt/venv/bin/pip install --no-index --find-links /root/.cache/pip/wheels --require-hashes -r /tmp/requirements-operator.txt
WORKDIR /src
COPY pyproject.toml ./
COPY api/ api/
COPY operator/ operator/
COPY runtime/ runtime/
# --no-deps: every dependency is already in the venv from the lock; nothing unpinned sneaks in.
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation . \
 && /opt/venv/bin/python -c "import tg_operator, tgapi, kopf" \
 && ! /opt/venv/bin/python -c "import torch" 2>/dev/null \
 && ! /opt/venv/bin/python -c "import ray" 2>/dev/null

FROM ${BASE_IMAGE}
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
# Last, so a retagged base (same content, new name) reuses every layer above: a build arg
# in scope becomes part of each later RUN's cache key.
ARG BASE_IMAGE
LABEL org.opencontainers.image.title="trainergroup-operator" \
      org.opencontainers.image.description="kopf operator: TrainerGroup -> KubeRay RayCluster + detached Megatron workers" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
