"""Server entrypoint: create a TrainerGroup's detached worker group, announce it, exit.

    python -m tgruntime.entrypoints.server -f tg.yaml              # tgctl up runs this
    python -m tgruntime.entrypoints.server --spec-b64 B64 --generation N   # the operator's Ray job

It connects to Ray, creates the group (re-using a healthy group of the same generation,
so a retried job is idempotent), runs ``init_model`` on every worker, publishes the
group record, prints one ``TG_GROUP_READY {json}`` line and exits 0. Any failure tears
down whatever this run created, prints ``TG_GROUP_FAILED {json}`` and exits 1.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import sys
import time

import tgapi
from tgapi import markers
from tgruntime.controller import WorkerGroup, registry, teardown_group
from tgruntime.controller.connect import connect
from tgruntime.controller.errors import (
    GroupNotFoundError,
    PlacementInfeasibleError,
    TrainerGroupError,
)
from tgruntime.launch import create, plan, report

log = logging.getLogger("tgruntime.entrypoints.server")


def load_resource(args: argparse.Namespace) -> tgapi.TrainerGroup:
    if args.file:
        return tgapi.load_file(args.file, local=True)
    raw = base64.b64decode(args.spec_b64).decode() if args.spec_b64 else args.spec_json
    return tgapi.parse_resource(json.loads(raw), local=True)


def existing_healthy(tg: tgapi.TrainerGroup, generation: int) -> WorkerGroup | None:
    """A live group of the same generation (a retried job), or None after removing a stale one."""
    try:
        wg = WorkerGroup.attach(
            group_name=tg.group_name, ray_namespace=tg.ray_namespace, timeout_s=10
        )
    except GroupNotFoundError:
        return None
    states = [h.state for h in wg.health(timeout_s=10)]
    if wg.generation == generation and all(s == "ALIVE" for s in states):
        log.info(
            "group %s generation %d already running and healthy: re-using it",
            tg.group_name,
            generation,
        )
        return wg
    log.warning(
        "removing stale group %s (generation %d, states %s) before creating generation %d",
        tg.group_name,
        wg.generation,
        states,
        generation,
    )
    teardown_group(group_name=tg.group_name, ray_namespace=tg.ray_namespace)
    return None


def run(tg: tgapi.TrainerGroup, *, generation: int, address: str | None) -> markers.GroupReady:
    """plan -> create (or re-use) -> init -> report; each value is computed once, in the plan."""
    connect(address=address, ray_namespace=tg.ray_namespace)
    cluster = create.cluster_resources()
    p = plan.plan(tg, generation=generation, cluster=cluster)
    if p.gpu_auto:
        log.info(
            "workers.useGpu auto -> %s (the cluster has %g GPUs)",
            str(p.use_gpu).lower(),
            cluster.gpus,
        )
    tg = p.tg
    wg = existing_healthy(tg, generation)
    created = wg is None
    try:
        if wg is None:
            t0 = time.monotonic()
            wg = create.create(p)
            log.info(
                "created %d workers in %.1fs: %s",
                wg.world_size,
                time.monotonic() - t0,
                wg.worker_names,
            )
        t0 = time.monotonic()
        results = wg.init_model()
        device = report.device_summary(results)
        resumed = report.resume_summary(results)
        log.info(
            "init_model done in %.1fs, mesh %s, device %s", time.monotonic() - t0, p.mesh, device
        )
        if resumed.get("resumedFrom"):
            log.info(
                "resumed from %s at step %s", resumed["resumedFrom"], resumed.get("resumedStep")
            )
        from tgruntime.trainer.gpu_check import cpu_fallback_allowed

        if p.use_gpu and device.get("device") in ("cpu", "mixed") and not cpu_fallback_allowed():
            # GPU or fail (issue 36): the built-in trainer's ranks refuse by themselves
            # (NoCudaDeviceError); this catches a worker class that reports a CPU fallback
            import torch

            from tgruntime.trainer.gpu_check import GpuWorkersOnCpuError

            raise GpuWorkersOnCpuError(
                device=str(device["device"]), torch_cuda=torch.version.cuda
            )
        if device:  # what the workers run on, for status readers (tgctl status, the operator)
            registry.update_record(
                group_name=tg.group_name, ray_namespace=tg.ray_namespace, device=device
            )
        return report.ready_payload(
            wg,
            mesh=p.mesh,
            worker_class=tg.spec.workers.worker_class,
            use_gpu=p.use_gpu,
            device=device,
            resumed=resumed,
        )
    except PlacementInfeasibleError:
        raise  # refused before anything was created: nothing to tear down
    except BaseException:
        if created:
            log.error("creation failed: tearing down what this run created")
            teardown_group(group_name=tg.group_name, ray_namespace=tg.ray_namespace)
        raise


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tg-server", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-f", "--file", help="TrainerGroup YAML file")
    src.add_argument(
        "--spec-b64", help="base64 of the TrainerGroup object as JSON (the operator's form)"
    )
    src.add_argument("--spec-json", help="the TrainerGroup object as JSON")
    p.add_argument(
        "--generation", type=int, default=0, help="group generation (restarts increase it)"
    )
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or auto)")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    try:
        tg = load_resource(args)
        payload = run(tg, generation=args.generation, address=args.address)
    except (tgapi.SpecErrors, ValueError, TrainerGroupError) as exc:
        failed = markers.GroupFailed(error=str(exc), kind=type(exc).__name__)
        print(markers.line(failed), flush=True)
        print(f"tg-server: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        log.exception("server failed")
        name = type(exc).__name__
        print(markers.line(markers.GroupFailed(error=f"{name}: {exc}", kind=name)), flush=True)
        return 1
    print(markers.line(payload), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
