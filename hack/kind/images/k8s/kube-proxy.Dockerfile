# registry.k8s.io/kube-proxy stand-in: kube-proxy on the Debian utility image (iptables).
# kubeadm's DaemonSet runs `/usr/local/bin/kube-proxy ...`: that is a small wrapper which
# first selects the node's iptables backend (upstream's image does this with
# iptables-wrappers), then execs the real binary.
ARG NET_IMAGE
FROM ${NET_IMAGE}
COPY bin/kube-proxy /usr/local/bin/kube-proxy.bin
RUN printf '#!/bin/sh\n/usr/local/bin/select-iptables\nexec /usr/local/bin/kube-proxy.bin "$@"\n' > /usr/local/bin/kube-proxy \
    && chmod 0755 /usr/local/bin/kube-proxy
