"""Benchmark of the single-controller layer (tgruntime.controller) on a local Ray.

Measured side by side in one run, on a Ray head this script starts (and stops):

1. Overhead of a no-op group call (Dispatch.ONE_TO_ALL, blocking) on 2 and 8 workers,
   against the direct Ray round trip to the same actors (``ray.get([a.noop.remote() ...])``)
   and to one actor.
2. DataProto round trip client -> workers -> client (Dispatch.DP_COMPUTE_PROTO over 2
   workers, each returning its chunk; the client concatenates) for 1 MB .. 1 GB, against
   a plain in-memory copy of the same bytes, against Ray's own numpy round trip of the
   same bytes (two halves to two actors and back, concatenated), and, up to 256 MB,
   against the same tensors sent as plain (pickled) torch tensors.
3. Attach latency by group name (``WorkerGroup.attach``), 2 and 8 workers.

Prints a table and writes docs/results/bench_controller.json.

    .venv/bin/python bench/bench_controller.py [--quick] [--sizes-mb 1,64,256,1024]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from tgruntime.controller import (  # noqa: E402
    ClassWithInitArgs,
    DataProto,
    ResourcePool,
    WorkerGroup,
)
from tgruntime.controller import connect as ray_connect  # noqa: E402
from tgruntime.controller.decorator import Dispatch, register  # noqa: E402
from tgruntime.controller.worker import Worker  # noqa: E402
from tgruntime.local import head as local_head  # noqa: E402

NAMESPACE = "bench"


class BenchWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: Any) -> Any:
        return data

    def echo_raw(self, value: Any) -> Any:  # plain actor method for the baselines
        return value


def timeit(fn: Callable[[], Any], *, repeat: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median_s": statistics.median(s),
        "mean_s": statistics.fmean(s),
        "p10_s": s[max(0, int(len(s) * 0.1) - 1)],
        "p90_s": s[min(len(s) - 1, int(len(s) * 0.9))],
        "n": len(s),
    }


def call_overhead(wg: WorkerGroup, repeat: int) -> dict[str, Any]:
    handles = cast("list[Any]", wg.workers)  # a fresh group: every rank has a handle

    def group() -> None:
        wg.noop()

    def direct_all() -> None:
        ray.get([h.noop.remote() for h in handles])

    def direct_one() -> None:
        ray.get(handles[0].noop.remote())

    # interleave the three so load changes hit them alike
    samples: dict[str, list[float]] = {"group": [], "direct_all": [], "direct_one": []}
    for fn in (group, direct_all, direct_one):
        for _ in range(20):
            fn()
    for _ in range(repeat):
        for name, fn in (("group", group), ("direct_all", direct_all), ("direct_one", direct_one)):
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
    res: dict[str, Any] = {k: stats(v) for k, v in samples.items()}
    res["ratio_group_vs_direct_all"] = res["group"]["median_s"] / res["direct_all"]["median_s"]
    return res


def make_batch(nbytes: int) -> DataProto:
    rows = 256
    cols = max(1, nbytes // 8 // rows)
    return DataProto.from_dict(
        tensors={"x": torch.arange(rows * cols, dtype=torch.int64).reshape(rows, cols)}
    )


def transfer(wg: WorkerGroup, nbytes: int, repeat: int, with_torch: bool) -> dict[str, Any]:
    data = make_batch(nbytes)
    real = data.nbytes
    handles = cast("list[Any]", wg.workers[:2])  # a fresh group: every rank has a handle
    assert data.batch is not None
    src = data.batch["x"]
    arr = src.numpy()
    halves = np.array_split(arr, 2)

    def dataproto() -> None:
        out = wg.echo(data)
        assert len(out) == len(data)

    def numpy_ray() -> None:
        outs = ray.get([h.echo_raw.remote(p) for h, p in zip(handles, halves, strict=True)])
        np.concatenate(outs)

    torch_halves = list(torch.chunk(src, 2))

    def torch_ray() -> None:
        outs = ray.get([h.echo_raw.remote(p) for h, p in zip(handles, torch_halves, strict=True)])
        torch.cat(outs)

    def copy_fresh() -> None:  # a plain copy into new memory (numpy: huge pages, the fastest here)
        np.array(arr, copy=True)

    dst = np.empty_like(arr)

    def copy_warm() -> None:  # into memory already mapped
        np.copyto(dst, arr)

    res: dict[str, Any] = {"bytes": real}
    plan: list[tuple[str, Callable[[], None]]] = [
        ("dataproto_round_trip", dataproto),
        ("ray_numpy_round_trip", numpy_ray),
        ("memcpy_fresh", copy_fresh),
        ("memcpy_warm", copy_warm),
    ]
    # interleaved: one run of each per round, so load changes hit them alike
    samples: dict[str, list[float]] = {name: [] for name, _ in plan}
    for _ in range(2):
        for _, fn in plan:
            fn()
    for _ in range(repeat):
        for name, fn in plan:
            gc.collect()
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
    if with_torch:
        samples["ray_torch_pickle_round_trip"] = timeit(torch_ray, repeat=1, warmup=0)
    for name, values in samples.items():
        res[name] = stats(values)
        res[name]["MBps"] = real / res[name]["median_s"] / 1e6
    res["ratio_dataproto_vs_ray_numpy"] = (
        res["dataproto_round_trip"]["median_s"] / res["ray_numpy_round_trip"]["median_s"]
    )
    plan.clear()
    return res


def attach_latency(group_name: str, repeat: int) -> dict[str, Any]:
    WorkerGroup.attach(group_name=group_name, ray_namespace=NAMESPACE)
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        WorkerGroup.attach(group_name=group_name, ray_namespace=NAMESPACE)
        samples.append(time.perf_counter() - t)
    return stats(samples)


def fmt_us(s: float) -> str:
    return f"{s * 1e6:,.0f} µs"


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:,.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, sizes up to 64 MB")
    parser.add_argument("--sizes-mb", default="1,64,256,1024")
    parser.add_argument("--out", default=str(REPO / "docs" / "results" / "bench_controller.json"))
    parser.add_argument(
        "--address", default=None, help="use a running Ray head instead of starting one"
    )
    args = parser.parse_args()
    sizes = [int(float(s) * 2**20) for s in args.sizes_mb.split(",")]
    if args.quick:
        sizes = [s for s in sizes if s <= 64 * 2**20]
    calls = 100 if args.quick else 400

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    head = None
    if args.address:
        address = args.address
    else:
        head = local_head.start_local_head(
            num_cpus=2,
            object_store_memory=5 * 2**30,
            env={"RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"]},
        )
        address = head.gcs_address
    results: dict[str, Any] = {}
    try:
        ray_connect.connect(address, ray_namespace=NAMESPACE)
        groups = {}
        for n in (2, 8):
            name = f"bench{n}"
            from tgruntime.controller import teardown_group

            teardown_group(group_name=name, ray_namespace=NAMESPACE)
            t = time.perf_counter()
            groups[n] = WorkerGroup.create(
                group_name=name, ray_namespace=NAMESPACE,
                resource_pool=ResourcePool(process_on_nodes=[n], cpus_per_process=0.2),
                cls=ClassWithInitArgs(BenchWorker), actor_timeout_s=300,
            )
            results[f"create_{n}_workers_s"] = time.perf_counter() - t
        results["call_overhead"] = {str(n): call_overhead(groups[n], calls) for n in (2, 8)}
        results["attach"] = {
            str(n): attach_latency(f"bench{n}", 50 if args.quick else 200) for n in (2, 8)
        }
        results["transfer"] = {}
        for size in sizes:
            repeat = (
                20
                if size <= 2**20
                else (10 if size <= 64 * 2**20 else (7 if size <= 256 * 2**20 else 4))
            )
            if args.quick:
                repeat = max(2, repeat // 2)
            results["transfer"][str(size)] = transfer(
                groups[2], size, repeat, with_torch=64 * 2**20 <= size <= 256 * 2**20
            )
        for wg in groups.values():
            wg.teardown()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if head is not None:
            local_head.stop_local_head(head)

    results["machine"] = {
        "cpus": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(render(results))
    print(f"\nresults written to {args.out}")


def render(r: dict[str, Any]) -> str:
    lines = [
        "## No-op call (median of interleaved runs)",
        "",
        "| workers | group call | direct, all actors | direct, one actor | group / direct-all |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, c in r["call_overhead"].items():
        lines.append(
            f"| {n} | {fmt_us(c['group']['median_s'])} | {fmt_us(c['direct_all']['median_s'])} | "
            f"{fmt_us(c['direct_one']['median_s'])} | {c['ratio_group_vs_direct_all']:.2f}x |"
        )
    lines += [
        "",
        "## DataProto round trip client -> 2 workers -> client (median)",
        "",
        "| size | DataProto | Ray numpy | torch tensors (pickled) | memcpy (fresh) | memcpy (warm) "
        "| DataProto / Ray numpy |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for _, t in r["transfer"].items():
        mb = t["bytes"] / 2**20
        torch_cell = (
            fmt_ms(t["ray_torch_pickle_round_trip"]["median_s"])
            if "ray_torch_pickle_round_trip" in t
            else "-"
        )
        lines.append(
            f"| {mb:,.0f} MB | {fmt_ms(t['dataproto_round_trip']['median_s'])} "
            f"({t['dataproto_round_trip']['MBps']:,.0f} MB/s) | "
            f"{fmt_ms(t['ray_numpy_round_trip']['median_s'])} | "
            f"{torch_cell} | {fmt_ms(t['memcpy_fresh']['median_s'])} | "
            f"{fmt_ms(t['memcpy_warm']['median_s'])} | "
            f"{t['ratio_dataproto_vs_ray_numpy']:.2f}x |"
        )
    lines += ["", "## Attach by group name", "", "| workers | median | p90 |", "|---:|---:|---:|"]
    for n, a in r["attach"].items():
        lines.append(f"| {n} | {fmt_ms(a['median_s'])} | {fmt_ms(a['p90_s'])} |")
    lines += [
        "",
        f"group creation: 2 workers {r['create_2_workers_s']:.1f} s, 8 workers "
        f"{r['create_8_workers_s']:.1f} s",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
