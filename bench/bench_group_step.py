"""Training step through a detached TrainerGroup vs the same model run directly (no Ray).

For each case the *direct* path (``bench_step.run_direct``: torch.distributed processes,
no Ray) and the *group* path run the same spec on the same deterministic batches:

1. a local Ray head is started (all GPUs of the machine, or logical CPUs);
2. the server entrypoint creates the detached group in its own process, which exits;
3. a client process attaches **by group name**, measures attach latency and the first
   call (a mesh query), then times ``train_model`` round trips (client wall clock);
4. the teardown entrypoint removes the group, and the head is stopped.

It prints a table and writes JSON (``--json``). Ratio = direct median step / group
median step (1.0 = the group costs nothing; target >= 0.98).

    python bench/bench_group_step.py --case tiny:tp2 --steps 10                # CPU here
    python bench/bench_group_step.py --case seed:tp1 --case large:tp1 --json r.json   # H200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step
import tgapi
from tgapi import markers
from tgruntime.trainer.steptime import flops_per_step, summarize

PY = sys.executable


def _resource(spec: tgapi.TrainerGroupSpec, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "trainergroup.io/v1alpha1",
        "kind": "TrainerGroup",
        "metadata": {"name": name, "namespace": "bench"},
        "spec": tgapi.to_wire(spec),
    }


def client_role(args: argparse.Namespace) -> int:
    """Runs in its own process: attach by name, time the first call and the steps."""
    import torch

    from tgruntime.controller import DataProto, WorkerGroup
    from tgruntime.controller.connect import connect
    from tgruntime.trainer.steptime import bench_batch

    spec = tgapi.parse_resource(json.loads(args.spec_json), local=True).spec
    connect(address=args.address, ray_namespace=args.ray_namespace)
    t0 = time.perf_counter()
    wg = WorkerGroup.attach(group_name=args.group, ray_namespace=args.ray_namespace)
    attach_ms = (time.perf_counter() - t0) * 1e3
    attach_again = []
    for _ in range(5):
        t0 = time.perf_counter()
        WorkerGroup.attach(group_name=args.group, ray_namespace=args.ray_namespace)
        attach_again.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    meshes = wg.get_mesh()
    first_call_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    wg.get_mesh()
    second_call_ms = (time.perf_counter() - t0) * 1e3
    wall, worker_step, losses = [], [], []
    for i in range(args.warmup + args.steps):
        data = DataProto.from_dict(tensors={"input_ids": bench_batch(spec, i)})
        t0 = time.perf_counter()
        out = wg.train_model(data)
        dt = time.perf_counter() - t0
        losses.append(float(out.meta_info.get("loss", out.batch["loss"].float().mean())))
        if i >= args.warmup:
            wall.append(dt)
            worker_step.append(float(out.meta_info.get("step_time_s", float("nan"))))
        print(
            f"client step {i}: {dt * 1e3:.1f} ms loss {losses[-1]:.4f}", file=sys.stderr, flush=True
        )
    print(
        "BENCH_CLIENT "
        + json.dumps(
            {
                "attach_ms_first": attach_ms,
                "attach_ms_warm": statistics.median(attach_again),
                "first_call_ms": first_call_ms,
                "second_call_ms": second_call_ms,
                "wall_step_s": wall,
                "worker_step_s": worker_step,
                "losses": losses,
                "mesh": meshes[0],
                "peak_memory_gib": float(out.meta_info.get("peak_memory_gib", float("nan"))),
                "torch": torch.__version__,
            }
        ),
        flush=True,
    )
    return 0


def teardown(tg: Any, *, gcs_address: str) -> None:
    """``tg-teardown`` of the benchmark's group (its workers, placement groups and record)."""
    _run(
        [PY, "-m", "tgruntime.entrypoints.teardown", "--group", tg.group_name,
         "--ray-namespace", tg.ray_namespace, "--address", gcs_address],
        timeout=300,
        what="teardown",
    )


def _run(cmd: list[str], *, timeout: float, what: str) -> subprocess.CompletedProcess[str]:
    print(
        f"[{time.strftime('%H:%M:%S')}] {what}: {' '.join(cmd[:4])} ...",
        file=sys.stderr,
        flush=True,
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"{what} failed with exit code {proc.returncode}")
    return proc


def run_group(
    spec: tgapi.TrainerGroupSpec, *, name: str, steps: int, warmup: int, gpus: int
) -> dict[str, Any]:
    from tgruntime.local.head import start_local_head, stop_local_head

    body = json.dumps(_resource(spec, name))
    tg = tgapi.parse_resource(json.loads(body), local=True)
    cpus = max(2, int(spec.world_size * spec.workers.cpus_per_process) + 1)
    head = start_local_head(num_cpus=cpus, num_gpus=gpus)
    try:
        t0 = time.perf_counter()
        server = _run(
            [PY, "-m", "tgruntime.entrypoints.server", "--spec-json", body,
             "--address", head.gcs_address],
            timeout=1200,
            what="server (creates the detached group, exits)",
        )
        server_s = time.perf_counter() - t0
        ready = markers.parse_last(markers.GroupReady, server.stdout)
        assert ready is not None, server.stdout[-2000:]
        client = _run(
            [
                PY,
                __file__,
                "--role",
                "client",
                "--address",
                head.gcs_address,
                "--group",
                tg.group_name,
                "--ray-namespace",
                tg.ray_namespace,
                "--spec-json",
                body,
                "--steps",
                str(steps),
                "--warmup",
                str(warmup),
            ],
            timeout=1800,
            what="client (attaches by name)",
        )
        measured = next(
            (
                json.loads(ln.split(" ", 1)[1])
                for ln in reversed(client.stdout.splitlines())
                if ln.startswith("BENCH_CLIENT ")
            ),
            None,
        )
        assert measured is not None, client.stdout[-2000:]
        teardown(tg, gcs_address=head.gcs_address)
    finally:
        stop_local_head(head)
    stats = summarize(measured["wall_step_s"])
    tokens = spec.training.batch_size * spec.training.sequence_length
    flops = flops_per_step(spec)
    mesh = measured["mesh"]
    row: dict[str, Any] = {
        "path": "group",
        "world_size": spec.world_size,
        "tp": spec.parallelism.tensor,
        "pp": spec.parallelism.pipeline,
        "dp": spec.data_parallel,
        "device": str(mesh.get("device", "?")).split(":")[0],
        "dtype": mesh.get("dtype", "?"),
        "model": tgapi.to_wire(spec.model),
        "batch": [spec.training.batch_size, spec.training.sequence_length],
        "steps": steps,
        "warmup": warmup,
        "step_s": stats,
        "worker_step_s": summarize(
            [x for x in measured["worker_step_s"] if x == x] or [float("nan")]
        ),
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / stats["median"],
        "flops_per_step": flops,
        "achieved_tflops": flops / stats["median"] / 1e12,
        "first_loss": measured["losses"][0],
        "final_loss": measured["losses"][-1],
        "server_s": server_s,
        "worker_names": list(ready.worker_names),
        "attach_ms_first": measured["attach_ms_first"],
        "attach_ms_warm": measured["attach_ms_warm"],
        "first_call_ms": measured["first_call_ms"],
        "second_call_ms": measured["second_call_ms"],
    }
    if measured["peak_memory_gib"] == measured["peak_memory_gib"]:
        row["peak_memory_gib"] = measured["peak_memory_gib"]
    return row


def parse_case(text: str) -> tuple[str, int, int]:
    """``preset:tpN[:dpM]`` -> (preset, tp, world)."""
    parts = text.split(":")
    preset, tp, dp = parts[0], 1, 1
    for p in parts[1:]:
        if p.startswith("tp"):
            tp = int(p[2:])
        elif p.startswith("dp"):
            dp = int(p[2:])
    return preset, tp, tp * dp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", default="suite", choices=["suite", "client"])
    p.add_argument(
        "--case",
        action="append",
        default=[],
        help="preset:tpN[:dpM], repeatable (default tiny:tp2)",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--skip-direct", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--address"), p.add_argument("--group"), p.add_argument("--ray-namespace")
    p.add_argument("--spec-json")
    args = p.parse_args(argv)
    if args.role == "client":
        return client_role(args)

    import torch

    gpu = torch.cuda.is_available()
    ngpu = torch.cuda.device_count() if gpu else 0
    rows: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    for case in args.case or ["tiny:tp2"]:
        preset, tp, world = parse_case(case)
        if gpu and world > ngpu:
            print(f"skipping {case}: needs {world} GPUs, this machine has {ngpu}", file=sys.stderr)
            continue
        spec = bench_step.preset_spec(preset, gpu=gpu, tp=tp, world=world)
        if not gpu:
            spec = tgapi.parse_spec(
                {
                    **tgapi.to_wire(spec),
                    "model": {**tgapi.to_wire(spec.model), "dtype": "float32"},
                    "workers": {**tgapi.to_wire(spec.workers), "cpusPerProcess": 0.5},
                },
                local=True,
            )
        name = f"bench-{preset}-tp{tp}-w{world}".replace("_", "-")
        direct = None
        if not args.skip_direct:
            print(f"[{time.strftime('%H:%M:%S')}] direct {case}", file=sys.stderr, flush=True)
            direct = bench_step.run_direct(
                spec, steps=args.steps, warmup=args.warmup, device="cuda" if gpu else "cpu"
            )
            direct["case"] = case
            rows.append(direct)
        print(f"[{time.strftime('%H:%M:%S')}] group {case}", file=sys.stderr, flush=True)
        group = run_group(spec, name=name, steps=args.steps, warmup=args.warmup, gpus=ngpu)
        group["case"] = case
        for row in (direct, group):
            if row is not None:
                row["megatron_core"] = _megatron_version()
        if direct is not None:
            if "matmul_tflops" in direct:
                group["matmul_tflops"] = direct["matmul_tflops"]
                group["mfu"] = group["achieved_tflops"] / (
                    direct["matmul_tflops"] * group["world_size"]
                )
            comparisons.append({"case": case, **bench_step.compare(direct, group)})
        rows.append(group)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"rows": rows, "comparisons": comparisons}, indent=2))
    print(bench_step.format_table(rows))
    print()
    for r in rows:
        if r["path"] == "group":
            print(
                f"{r['case']}: server {r['server_s']:.1f}s, attach first "
                f"{r['attach_ms_first']:.1f} ms / warm "
                f"{r['attach_ms_warm']:.1f} ms, first call {r['first_call_ms']:.1f} ms, second "
                f"call {r['second_call_ms']:.1f} ms"
            )
    for c in comparisons:
        print(
            f"{c['case']}: direct {c['direct_step_s'] * 1e3:.1f} ms, group "
            f"{c['group_step_s'] * 1e3:.1f} ms, "
            f"ratio {c['ratio']:.3f}, overhead {c['overhead_ms']:+.1f} ms/step"
        )
    return 0


def _megatron_version() -> str:
    """The megatron-core this process imported (stack comparisons put another one first)."""
    import megatron.core

    return str(megatron.core.__version__)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
