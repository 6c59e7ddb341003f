"""A ReadWriteMany checkpoint claim for the kind suite: a static PersistentVolume on a directory
that every worker node of the cluster sees, and a claim bound to it by name.

    python3 tests/e2e/lib/shared_claim.py --claim C --pv P --namespace NS \
        --path /var/lib/tg-shared/DIR --nodes NODE1,NODE2 | kubectl apply -f -

Why not NFS: this machine's kernel has neither an NFS client nor an NFS server
(``CONFIG_NFS_FS`` and ``CONFIG_NFSD`` are unset), so no pod here can mount an NFS export, and
kind's own local-path provisioner hands out node-local (ReadWriteOnce) directories. What a
network filesystem gives a cluster, one tree that every node reads and writes, comes from
hack/kind/cluster.sh instead: it bind-mounts one host directory at ``/var/lib/tg-shared`` in
both worker nodes, as a platform mounts one NFS export on every node. The volume here is of
type ``local`` on that tree, reachable from every listed node (its node affinity), with access
mode ReadWriteMany, so a worker pod on the GPU node and the Tinker server on the CPU node mount
the same files. ``local`` and not ``hostPath``: the kubelet applies the pods' ``fsGroup`` to a
``local`` volume, so the directory can start as a fresh export does (root's, 0755) and only
the pods' ``fsGroup`` makes it writable by the runtime's user (nothing world-writable).

Prints a ``v1 List`` as JSON. Used by tests/e2e/lib/clients.sh (``e2e_claim``) and
tests/e2e/chaos.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

PART_OF = {"app.kubernetes.io/part-of": "trainergroup-e2e"}
SHARED_MOUNT = "/var/lib/tg-shared"
"""Where hack/kind/cluster.sh mounts the shared host directory in each worker node."""


def objects(
    *, claim: str, pv: str, namespace: str, path: str, nodes: list[str], size: str = "1Gi"
) -> list[dict[str, Any]]:
    """The PersistentVolume and its claim (ReadWriteMany, bound by name, no StorageClass)."""
    if not nodes:
        raise ValueError("--nodes: name at least one node that sees the shared directory")
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": pv, "labels": dict(PART_OF)},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": ["ReadWriteMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "volumeMode": "Filesystem",
            "local": {"path": path},
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}
                            ]
                        }
                    ]
                }
            },
        },
    }
    bound = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim, "namespace": namespace, "labels": dict(PART_OF)},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "volumeName": pv,
            "resources": {"requests": {"storage": size}},
        },
    }
    return [volume, bound]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--claim", required=True)
    ap.add_argument("--pv", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--path", required=True, help=f"a directory under {SHARED_MOUNT}")
    ap.add_argument("--nodes", required=True, help="comma-separated nodes that see --path")
    args = ap.parse_args(argv)
    nodes = [n for n in args.nodes.split(",") if n]
    items = objects(
        claim=args.claim, pv=args.pv, namespace=args.namespace, path=args.path, nodes=nodes
    )
    json.dump({"apiVersion": "v1", "kind": "List", "items": items}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
