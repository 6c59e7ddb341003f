"""tgctl: the TrainerGroup workflow on a laptop or any single machine (the embedded default).

    tgctl up -f tg.yaml            start a local Ray head if none is reachable; create the group
    tgctl status -f tg.yaml        phase and per-worker state
    tgctl train -f tg.yaml --steps 5
    tgctl down -f tg.yaml [--stop-ray]

The same TrainerGroup YAML as on Kubernetes; ``rayCluster``/``rayClusterRef`` are ignored.
``up`` runs the server entrypoint in its own process, which exits once the detached
group exists: the group outlives it, exactly as on a cluster.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import tgspec
from tgruntime import groups, local_ray
from tgruntime.controller.errors import GroupNotFoundError, TrainerGroupError

log = logging.getLogger("tgctl")


def _load(path: str) -> tgspec.TrainerGroup:
    return tgspec.load_file(path, local=True)


def cmd_up(args: argparse.Namespace) -> int:
    tg = _load(args.file)
    head = local_ray.ensure(address=args.address, num_cpus=args.num_cpus, num_gpus=args.num_gpus)
    cmd = [sys.executable, "-m", "tgruntime.server", "-f", args.file, "--address", head.gcs_address]
    log.info(
        "creating group %s in Ray namespace %s (%d workers)",
        tg.group_name,
        tg.ray_namespace,
        tg.spec.world_size,
    )
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=tg.spec.timeouts.workers_ready_seconds + 120
    )
    sys.stderr.write(proc.stderr)
    ready = groups.parse_tagged(groups.READY_TAG, proc.stdout)
    if proc.returncode != 0 or ready is None:
        failed = groups.parse_tagged(groups.FAILED_TAG, proc.stdout) or {
            "error": f"server exited {proc.returncode}"
        }
        print(f"tgctl up: {failed['error']}", file=sys.stderr)
        return 1
    print(
        f"group {ready['groupName']} is up in Ray namespace {ready['rayNamespace']} "
        f"(generation {ready['generation']}, mesh {ready['mesh']})"
    )
    print(f"  device: {describe_device(ready.get('useGpu'), ready)}")
    for rank, name in enumerate(ready["workerNames"]):
        print(f"  rank {rank}: {name}")
    return 0


def describe_device(use_gpu: Any, device: Mapping[str, Any]) -> str:
    """One line: what the workers run on and what was asked ("cuda (nccl, bfloat16), ...")."""
    dev = str(device.get("device") or "")
    parts = [str(device[k]) for k in ("backend", "dtype") if device.get(k)]
    text = f"{dev} ({', '.join(parts)})" if dev and parts else (dev or "not reported yet")
    if use_gpu is not None:
        text += f"; workers.useGpu resolved to {str(bool(use_gpu)).lower()}"
        if use_gpu and dev == "cpu":
            text += " but the workers found no CUDA device (CPU fallback)"
    return text


def _connect_existing(args: argparse.Namespace, tg: tgspec.TrainerGroup) -> None:
    from tgruntime.ray_connect import connect

    address = args.address
    if not address:
        known = local_ray.load()
        if known is None:
            raise TrainerGroupError(
                "no Ray cluster is known: run `tgctl up -f FILE` first, or pass --address"
            )
        address = known.gcs_address
    connect(address=address, namespace=tg.ray_namespace)


def cmd_status(args: argparse.Namespace) -> int:
    from tgruntime.controller import WorkerGroup, load_record

    tg = _load(args.file)
    _connect_existing(args, tg)
    try:
        wg = WorkerGroup.attach(group_name=tg.group_name, namespace=tg.ray_namespace, timeout_s=10)
    except GroupNotFoundError as exc:
        print(f"phase: NotFound\n{exc}\nRun `tgctl up -f {args.file}` to create it.")
        return 1
    health = wg.health(timeout_s=10)
    alive = sum(h.state == "ALIVE" for h in health)
    phase = "Ready" if alive == len(health) else "Degraded"
    print(
        f"phase: {phase}  ({alive}/{len(health)} workers alive, generation {wg.generation}, "
        f"Ray namespace {tg.ray_namespace})"
    )
    record = load_record(group_name=tg.group_name, namespace=tg.ray_namespace)
    if record is not None:
        print(f"device: {describe_device(record.use_gpu, record.device)}")
    print(f"{'RANK':<5} {'STATE':<12} {'PID':<8} {'NAME':<40} CAUSE")
    for h in health:
        print(f"{h.rank:<5} {h.state:<12} {h.pid or '':<8} {h.name:<40} {h.cause or ''}")
    return 0 if phase == "Ready" else 3


def cmd_train(args: argparse.Namespace) -> int:
    from tgruntime import client

    tg = _load(args.file)
    known = local_ray.load()
    address = args.address or (known.gcs_address if known else None)
    if address is None:
        print(
            "tgctl train: no Ray cluster is known: run `tgctl up -f FILE` first, or pass --address",
            file=sys.stderr,
        )
        return 1
    del tg
    argv = ["-f", args.file, "--steps", str(args.steps), "--address", address]
    if args.fresh_batches:
        argv.append("--fresh-batches")
    if args.save_checkpoint:
        argv += ["--save-checkpoint", args.save_checkpoint]
    return client.main(argv)


def cmd_down(args: argparse.Namespace) -> int:
    from tgruntime import teardown

    tg = _load(args.file)
    known = local_ray.load()
    address = args.address or (known.gcs_address if known else None)
    rc = 0
    if address is None:
        print("tgctl down: no Ray cluster is known; nothing to tear down")
    else:
        rc = teardown.main(
            ["--group", tg.group_name, "--ray-namespace", tg.ray_namespace, "--address", address]
        )
    if args.stop_ray:
        print(
            "stopped the local Ray head"
            if local_ray.stop()
            else "no local Ray head started by tgctl to stop"
        )
    return rc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tgctl", description="Run a TrainerGroup on local Ray (the embedded default)."
    )
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text)
        sp.add_argument("-f", "--file", required=True, help="TrainerGroup YAML")
        sp.add_argument(
            "--address",
            default=os.environ.get("TG_RAY_ADDRESS"),
            help="an existing Ray cluster's GCS address",
        )
        return sp

    up = add("up", "start local Ray if needed and create the group")
    up.add_argument(
        "--num-cpus", type=float, default=None, help="CPUs for a new local head (default: all)"
    )
    up.add_argument(
        "--num-gpus",
        type=int,
        default=None,
        help="GPUs for a new local head (default: detected without torch: CUDA_VISIBLE_DEVICES "
        "when set, else /proc/driver/nvidia/gpus, else `nvidia-smi -L`; 0 on a machine "
        "without NVIDIA GPUs). workers.useGpu \"auto\" (the default) then picks GPU or CPU "
        "workers from what the head has",
    )
    add("status", "show the group's phase and workers")
    tr = add("train", "attach and train")
    tr.add_argument("--steps", type=int, default=5)
    tr.add_argument("--fresh-batches", action="store_true", help="a new random batch every step")
    tr.add_argument("--save-checkpoint", default=None)
    dn = add("down", "tear the group down")
    dn.add_argument(
        "--stop-ray", action="store_true", help="also stop the local Ray head tgctl started"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    handlers = {"up": cmd_up, "status": cmd_status, "train": cmd_train, "down": cmd_down}
    try:
        return handlers[args.command](args)
    except tgspec.SpecErrors as exc:
        print(f"tgctl {args.command}: {exc}", file=sys.stderr)
        return 2
    except (TrainerGroupError, ValueError) as exc:
        print(f"tgctl {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
