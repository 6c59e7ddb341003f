# KubeRay's operator, packaged here from the binary that hack/build-tools.sh go-installs
# (github.com/ray-project/kuberay/ray-operator at hack/versions.env's KUBERAY_VERSION), because
# KubeRay's own image (quay.io/kuberay/operator) cannot be pulled on these machines.
#
#   hack/images/build.sh kuberay   (context: a directory holding the binary as `manager`)
#
# A drop-in for KubeRay's image as its Helm chart and config/manager/manager.yaml run it:
# the binary at /manager (their `command: [/manager]`, args appended), WORKDIR /, a numeric
# non-root user (65532, like upstream's distroless :nonroot), ENTRYPOINT ["/manager"].
# The binary is static (CGO_ENABLED=0); the Debian base adds CA certificates and tzdata.
ARG BASE_IMAGE=gcr.io/distroless/base-debian12:nonroot
FROM ${BASE_IMAGE}
ARG BASE_IMAGE
ARG KUBERAY_VERSION=unknown
LABEL org.opencontainers.image.title="kuberay-operator" \
      org.opencontainers.image.description="KubeRay operator built from the Go module (go install)" \
      org.opencontainers.image.version="${KUBERAY_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
WORKDIR /
COPY manager /manager
USER 65532:65532
ENTRYPOINT ["/manager"]
