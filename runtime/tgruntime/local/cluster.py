"""The embedded default: a local Ray head that tgctl starts on demand and remembers.

The head's addresses, its ``ray start`` pid and its temp (session) dir are kept in
``~/.cache/trainergroup/local-ray.json`` (``$XDG_CACHE_HOME`` when set) so that later
``tgctl`` commands reach the same head and ``tgctl down --stop-ray`` stops only a head
that tgctl itself started (``local_head.stop_local_head``: that pid, checked to be that
head's ``ray start``, and its process tree; no process-table scan).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

from tgruntime.controller import connect as ray_connect
from tgruntime.local import head as local_head

log = logging.getLogger("tgruntime.local.cluster")


def state_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "trainergroup" / "local-ray.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalRay:
    gcs_address: str
    dashboard_url: str  # "" when the head runs no dashboard (TG_RAY_INCLUDE_DASHBOARD=0)
    started_by_tgctl: bool
    pid: int | None = None  # the head's `ray start --block` process (started_by_tgctl)
    temp_dir: str = ""


def load() -> LocalRay | None:
    try:
        data = json.loads(state_file().read_text())
        known = {f.name for f in dataclasses.fields(LocalRay)}
        return LocalRay(**{k: v for k, v in data.items() if k in known})
    except (OSError, ValueError, TypeError):
        return None


def save(head: LocalRay) -> None:
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(head)))


def forget() -> None:
    state_file().unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class DetectedGpus:
    count: int
    source: str  # how it was found, for the log and the help text


def detect_gpus(timeout_s: float = 10.0) -> DetectedGpus:
    """Count this machine's NVIDIA GPUs without importing torch (or Ray's GPU probing).

    In order: ``CUDA_VISIBLE_DEVICES`` when set (its entries; "", "-1" or "NoDevFiles" mean
    none), then ``/proc/driver/nvidia/gpus/`` (one folder per GPU, Linux), then
    ``nvidia-smi -L`` (one "GPU n:" line per GPU; bounded by ``timeout_s``). No driver, no
    GPUs: 0.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if not entries or entries[0] in ("-1", "NoDevFiles"):
            return DetectedGpus(0, "CUDA_VISIBLE_DEVICES (empty)")
        # CUDA stops at the first invalid entry ("0,-1,2" is one device).
        count = 0
        for e in entries:
            if e == "-1":
                break
            count += 1
        return DetectedGpus(count, "CUDA_VISIBLE_DEVICES")
    proc = Path("/proc/driver/nvidia/gpus")
    try:
        found = [p for p in proc.iterdir() if p.is_dir()]
    except OSError:
        found = []
    if found:
        return DetectedGpus(len(found), str(proc))
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "-L"], capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return DetectedGpus(0, f"nvidia-smi -L (failed or over {timeout_s:g}s)")
        if out.returncode == 0:
            count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
            return DetectedGpus(count, "nvidia-smi -L")
        return DetectedGpus(0, f"nvidia-smi -L (exit {out.returncode})")
    return DetectedGpus(0, "no NVIDIA driver found")


def ensure(*, address: str | None, num_cpus: float | None, num_gpus: int | None) -> LocalRay:
    """Return a reachable Ray: the given address, the remembered head, or a new local head.

    A new head gets ``num_gpus`` GPUs, or, when None, the GPUs ``detect_gpus`` finds.
    """
    if address:
        return LocalRay(gcs_address=address, dashboard_url="", started_by_tgctl=False)
    known = load()
    if known is not None and ray_connect.is_reachable(known.gcs_address):
        return known
    if known is not None:
        log.warning(
            "the remembered local Ray head at %s is gone; starting a new one", known.gcs_address
        )
        forget()
    if num_gpus is None:
        detected = detect_gpus()
        num_gpus = detected.count
        log.info("detected %d GPU(s) (%s)", detected.count, detected.source)
    # Generous: on a busy 2-core laptop the head (dashboard included) can take minutes.
    head = local_head.start_local_head(num_cpus=num_cpus, num_gpus=num_gpus, timeout_s=300)
    local = LocalRay(
        gcs_address=head.gcs_address,
        dashboard_url=head.dashboard_url,
        started_by_tgctl=True,
        pid=head.pid,
        temp_dir=head.temp_dir,
    )
    save(local)
    log.info(
        "started a local Ray head at %s with %d CPUs and %d GPUs (dashboard %s)",
        local.gcs_address,
        head.num_cpus,
        head.num_gpus,
        local.dashboard_url or "off",
    )
    return local


def stop() -> bool:
    """Stop the head tgctl started; False when there was none (or it was already gone)."""
    known = load()
    if known is None or not known.started_by_tgctl:
        return False
    stopped = False
    if known.pid is None or not known.temp_dir:
        log.warning(
            "the state file %s names no pid and temp dir of the head at %s: stop it yourself",
            state_file(), known.gcs_address,
        )
    else:
        stopped = local_head.stop_local_head(pid=known.pid, temp_dir=known.temp_dir)
    forget()
    return stopped
