"""The checkpoint claim's access mode: who mounts it, and whether its mode lets them (pure).

``rayCluster.storage.claimName`` names a PersistentVolumeClaim the platform made. Every worker
pod mounts it, and so do the Tinker server (``spec.api.tinker``, on by default: its state lives
in ``training.checkpointDir``) and the head (``model.pretrained``). A ReadWriteOnce volume is
attached to one node at a time (ReadWriteOncePod: to one pod), so as soon as a second pod mounts
the claim, or the workers span nodes, the pods that cannot attach it wait in
``ContainerCreating`` (a ``FailedAttachVolume`` Multi-Attach event) until the cluster timeout.

The operator reads the claim once before it creates (or re-creates) the RayCluster
(``get`` on persistentvolumeclaims) and, when its access modes cannot serve the pods that
mount it, refuses the group at once: phase Failed, the ``RayClusterReady`` condition with
reason :data:`REASON` and a message naming the claim, its modes, the pods and the fix. A claim
that is missing or unreadable (no RBAC) is not judged here: the pods' own events say why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from tg_operator import errors, names, outcomes, platform, tinker
from tg_operator.snapshot import Decision, Settings, Snapshot
from tgapi import TrainerGroup

RWX = "ReadWriteMany"
RWO = "ReadWriteOnce"
RWOP = "ReadWriteOncePod"
ROX = "ReadOnlyMany"
WRITABLE = (RWX, RWO, RWOP)
REASON = errors.ClaimAccessMode.reason


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mounters:
    """The pods that mount the checkpoint claim."""

    worker_pods: int
    worker_nodes: int
    """Entries of ``workers.processesPerNode``: the Ray nodes the training processes use."""
    tinker: bool
    head: bool

    @property
    def pods(self) -> int:
        return self.worker_pods + int(self.tinker) + int(self.head)

    @property
    def shared(self) -> bool:
        """More than one pod mounts the claim, or the workers span nodes."""
        return self.pods > 1 or self.worker_nodes > 1

    def describe(self) -> str:
        parts = [f"{self.worker_pods} worker pod{'s' if self.worker_pods != 1 else ''}"]
        if self.tinker:
            parts.append("the Tinker server (spec.api.tinker)")
        if self.head:
            parts.append("the head (model.pretrained)")
        text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        if self.worker_nodes > 1:
            text += f", with workers on {self.worker_nodes} nodes"
        return text


def mounters(tg: TrainerGroup) -> Mounters | None:
    """Who mounts ``rayCluster.storage`` (None: no storage, or a ``rayClusterRef`` group)."""
    rc = tg.spec.ray_cluster
    if rc is None or rc.storage is None:
        return None
    return Mounters(
        worker_pods=rc.workers.replicas,
        worker_nodes=len(tg.spec.workers.processes_per_node),
        tinker=tinker.wanted(tg),
        head=platform.head_reads_checkpoints(tg),
    )


def claim_name(tg: TrainerGroup) -> str | None:
    """The claim the operator reads before it creates the RayCluster (None: nothing to read)."""
    rc = tg.spec.ray_cluster
    if rc is None or rc.storage is None or not names.owns_cluster(tg):
        return None
    return rc.storage.claim_name


def access_modes(claim: Mapping[str, Any]) -> tuple[str, ...]:
    """The claim's access modes: its bound volume's (``status``) once bound, else the ones it
    asks for (``spec``)."""
    for part in ("status", "spec"):
        section = claim.get(part)
        modes = section.get("accessModes") if isinstance(section, Mapping) else None
        if isinstance(modes, Sequence) and not isinstance(modes, str) and modes:
            return tuple(str(m) for m in modes)
    return ()


def refusal(who: Mounters, *, claim: str, modes: Sequence[str]) -> str | None:
    """Why a claim with ``modes`` cannot serve ``who`` (None: it can, or its modes are unknown)."""
    if not modes or RWX in modes:
        return None
    shown = ", ".join(modes)
    fix = (
        "use a ReadWriteMany claim (an NFS, CephFS, EFS or Filestore class) in "
        "rayCluster.storage.claimName"
    )
    if not any(m in WRITABLE for m in modes):
        return (
            f"checkpoint claim {claim} is {shown}: its pods cannot write checkpoints; "
            f"fix: {fix}"
        )
    if not who.shared:
        return None
    scope = "one pod" if set(modes) == {RWOP} else "one node at a time"
    return (
        f"checkpoint claim {claim} is {shown}, which attaches to {scope}, but "
        f"{who.describe()} mount it: the pods that cannot attach it would wait in "
        f"ContainerCreating (Multi-Attach); fix: {fix}, or have one pod mount it (one worker "
        "pod, spec.api.tinker: false)"
    )


def refuse_claim(snap: Snapshot, cfg: Settings) -> Decision | None:
    """Rule ``claim-access-mode``: before the RayCluster is created, a claim whose access mode
    cannot serve the pods that mount it fails the group (until the spec changes)."""
    tg, claim = snap.tg, snap.claim
    if claim is None or snap.raycluster is not None:
        return None
    who, name = mounters(tg), claim_name(tg)
    if who is None or name is None:
        return None
    why = refusal(who, claim=name, modes=access_modes(claim))
    if why is None:
        return None
    return outcomes.fail(
        snap, snap.status, rule="claim-access-mode", error=errors.ClaimAccessMode, message=why
    )
