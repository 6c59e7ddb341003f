# A Kubernetes controller manager built here from its Go module, packaged the way its upstream
# image runs it, because upstream images cannot be pulled on these machines:
#   hack/images/build.sh kuberay   KubeRay's ray-operator (hack/build-tools.sh, KUBERAY_VERSION)
#   hack/images/build.sh kueue     Kueue's manager (hack/kueue/build.sh, KUEUE_VERSION)
# (context: a directory holding the binary as `manager`)
#
# A drop-in for the upstream images as their Helm charts run them: the binary at /manager
# (their `command: [/manager]`, args appended), WORKDIR /, a numeric non-root user (65532, like
# upstream's distroless :nonroot), ENTRYPOINT ["/manager"]. The binary is static
# (CGO_ENABLED=0); the Debian base adds CA certificates and tzdata.
ARG BASE_IMAGE=gcr.io/distroless/base-debian12:nonroot
FROM ${BASE_IMAGE}
ARG BASE_IMAGE
ARG TITLE=manager
ARG VERSION=unknown
LABEL org.opencontainers.image.title="${TITLE}" \
      org.opencontainers.image.description="${TITLE} built from its Go module (go install)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
WORKDIR /
COPY manager /manager
USER 65532:65532
ENTRYPOINT ["/manager"]
