# The runtime image: Ray (base image) + torch + megatron-core + tensordict + tgruntime.
# The kubernetes client (tgapi.kube_view, for tg-client) but not the operator's kopf.
# Used by the RayCluster pods the operator creates (TrainerGroup spec.image) and by the
# client Job (manifests/examples/client-job.yaml): same Ray and Python on both sides.
#
#   DOCKER_BUILDKIT=1 docker build -f images/runtime.Dockerfile -t ghcr.io/trainergroup/runtime:0.1.0 .
#   (or `make images`; the build context is the repository root)
#
# Here (no image registry reachable) `hack/images/build.sh runtime` builds it FROM a stand-in
# base made from Debian's packages (--build-arg BASE_IMAGE=..., hack/images/build-bases.sh) and
# hands pip the host's CA bundle as a BuildKit secret: `--secret id=pip-ca,src=FILE`. The secret
# is mounted only during the RUN that installs the lock; nothing of it stays in any layer.
# No `# syntax=` line: the Dockerfile frontend built into the engine's BuildKit is used, so
# nothing is pulled (RUN --mount needs Docker >= 20.10 with DOCKER_BUILDKIT=1).
#
# Ray 2.60.0 on Python 3.12 with CUDA, as KubeRay expects (ray CLI, bash, wget for its probes).
# torch 2.15.0 from PyPI ships CUDA 13 libraries: the nodes need an NVIDIA driver >= 580.

# Production base; a build argument so it can be swapped for a locally built stand-in that
# provides the same contract: user ray 1000:100, home /home/ray, a pip-able Python on PATH
# writable by uid 1000, bash, wget.
ARG BASE_IMAGE=rayproject/ray:2.60.0-py312-gpu
# gpu (default): torch with its CUDA libraries, for GPU nodes. cpu: the same lock without the
# CUDA libraries (nvidia-*: 3 GB; triton stays, megatron-core 0.19 imports it), with small
# stand-ins that let torch's CUDA build import and run on CPU (images/cuda_stubs.py), for CPU-only pods
# (the kind suite: `hack/images/build.sh runtime-cpu`, tagged <runtime image>-cpu).
ARG VARIANT=gpu

FROM ${BASE_IMAGE} AS deps
ARG VARIANT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# The base image runs as `ray` (uid 1000, gid 100) and its Python lives in ray's home.
USER 1000:100
COPY --chown=1000:100 images/requirements-runtime.txt /tmp/requirements-runtime.txt
COPY --chown=1000:100 images/cuda_stubs.py /tmp/cuda_stubs.py
# The wheels live in a BuildKit cache mount owned by uid 1000 (kept across builds, never in
# the image): `pip download -d` fetches only the files not there yet (hash-checked), then pip
# installs offline from that folder, so a rebuild (a changed lock or base, a cleared layer
# cache) does not download torch + nvidia-* (GBs) again. (pip's own HTTP cache is not enough:
# a proxy that sends no caching headers, as here, defeats it.)
# $NODEPS is empty or one flag: unquoted on purpose.
# hadolint ignore=SC2086
RUN --mount=type=cache,id=trainergroup-pip-runtime,target=/home/ray/.cache/pip,uid=1000,gid=100 \
    --mount=type=secret,id=pip-ca,required=false,mode=0444 \
    if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && NODEPS="" \
 && if [ "$VARIANT" = cpu ]; then python /tmp/cuda_stubs.py lock /tmp/requirements-runtime.txt && NODEPS=--no-deps; fi \
 && pip download $NODEPS --require-hashes -r /tmp/requirements-runtime.txt -d /home/ray/.cache/pip/wheels \
 && pip install $NODEPS --no-index --find-links /home/ray/.cache/pip/wheels --require-hashes -r /tmp/requirements-runtime.txt \
 && rm /tmp/requirements-runtime.txt

FROM deps AS cuda-gpu
RUN rm /tmp/cuda_stubs.py

# The stand-ins are compiled here with a C compiler and readelf; the packages this RUN added
# (only those: the base may have its own compiler) are purged in the same layer.
FROM deps AS cuda-cpu
USER 0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN dpkg-query -W -f '${Package}\n' | sort > /tmp/packages-before \
 && apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev binutils \
 && SITE="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
 && python /tmp/cuda_stubs.py stubs "$SITE" && chown -R 1000:100 "$SITE/nvidia" \
 && dpkg-query -W -f '${Package}\n' | sort | comm -13 /tmp/packages-before - \
  | xargs -r apt-get purge -y \
 && rm -rf /var/lib/apt/lists/* /tmp/cuda_stubs.py /tmp/packages-before
USER 1000:100
# Every symbol resolves now (LD_BIND_NOW), and torch sees no GPU instead of failing.
RUN LD_BIND_NOW=1 python -c "import torch, torch.distributed; assert not torch.cuda.is_available()"
# No CUDA in this variant, so GPU-or-fail cannot hold: workers given (fake) GPUs run on the CPU
# with a warning (tgruntime.trainer.gpu_check.CPU_FALLBACK_ENV). Never set in the GPU variant.
ENV TG_ALLOW_CPU_FALLBACK=1

# hadolint ignore=DL3006
FROM cuda-${VARIANT} AS runtime
ARG VARIANT
USER 1000:100
# Created by uid 1000 (WORKDIR alone would create it root-owned, and the build writes into it).
RUN mkdir -p /tmp/trainergroup-src
WORKDIR /tmp/trainergroup-src
COPY --chown=1000:100 pyproject.toml ./
COPY --chown=1000:100 api/ api/
COPY --chown=1000:100 operator/ operator/
COPY --chown=1000:100 runtime/ runtime/
# --no-deps: every dependency is in the lock above; the versions are checked right after.
# megatron-core >= 0.19 appends `+<git sha>` to __version__ when `git rev-parse` succeeds
# next to its files (a venv inside a git checkout): the check compares the release part only.
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
 && python -c "import ray, torch, tensordict, megatron.core, tgruntime, tgapi; \
assert ray.__version__ == '2.60.0', ray.__version__; \
assert torch.__version__.startswith('2.15.0'), torch.__version__; \
assert megatron.core.__version__.split('+')[0] == '0.19.2', megatron.core.__version__" \
 && python -c "import tgapi.kube_view, tgruntime.entrypoints.client_job" \
 && ! python -c "import kopf" 2>/dev/null \
 && rm -rf /tmp/trainergroup-src
WORKDIR /home/ray
ENV PYTHONUNBUFFERED=1
# Last, so a retagged base (same content, new name) reuses every layer above: a build arg
# in scope becomes part of each later RUN's cache key.
ARG BASE_IMAGE
LABEL io.trainergroup.runtime-variant="${VARIANT}" \
      org.opencontainers.image.title="trainergroup-runtime" \
      org.opencontainers.image.description="Ray + torch + megatron-core runtime for TrainerGroup workers and clients" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
