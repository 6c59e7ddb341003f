"""Where the detached group's per-step overhead goes (issue 22), in one run on one GPU.

The direct path (a TrainEngine in a plain spawned process, no Ray) and the group path (the
detached group the server entrypoint creates, attached by name, ``wg.train_model``) hold
their models on the same GPU at the same time and take turns, round after round, on the
same batches, so their ratio is measured under the same conditions (clocks, temperature).

Each group step is split with time stamps taken inside the worker (installed through Ray's
``__ray_call__``, no change to the runtime) and in the client (same machine, same clock):

- ``to_worker``: client call start -> the worker method's first line (dispatch, ``.remote``,
  Ray transport, the argument's fetch and deserialisation);
- ``pre``: -> ``engine.train_step`` entered; ``sync_in``: train_step's leading
  synchronisation and what it does outside its own timer; ``engine``: its ``step_time_s``
  (the figure the direct path reports);
- ``post``: train_step returned -> progress handed over (metrics, ``_record_progress``);
- ``back``: -> the client has the collected result (result DataProto, serialisation,
  transport, collect).

Variants, each in every round: ``group`` (as shipped), ``group-noprogress`` (the worker's
``_record_progress`` replaced by a no-op), and optionally more (``--variants``). Probes:
an empty ``__ray_call__`` round trip, and one carrying the step's DataProto. Finally a
torch.profiler pass over steps of the direct engine and of the worker (GPU kernel time by
category, GPU-idle time within the step).

    python bench/gpu/group_overhead.py --preset seed --rounds 4 --steps 6 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/


# ----------------------------------------------------------------------------- profiling
def kernel_summary(prof: Any, steps: int) -> dict[str, Any]:
    """GPU kernel time per step by category, top kernels, and GPU-idle time in the window."""
    from torch._C._autograd import DeviceType  # what torch.autograd re-exports

    cats = {
        "gemm": 0.0,
        "attention": 0.0,
        "optimizer": 0.0,
        "norm": 0.0,
        "copy/fill": 0.0,
        "elementwise/other": 0.0,
    }
    top: dict[str, float] = {}
    intervals: list[tuple[float, float]] = []
    kernels = []
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        if getattr(e, "is_user_annotation", False) or e.name.startswith(("Optimizer.", "##")):
            continue  # a record_function range on the GPU timeline, not a kernel
        start, end = float(e.time_range.start), float(e.time_range.end)
        if end <= start:
            continue
        intervals.append((start, end))
        kernels.append((start, end, e.name))
        dur = end - start
        name = e.name
        low = name.lower()
        if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")):
            cat = "gemm"
        elif any(k in low for k in ("flash", "fmha", "attention", "sdpa", "softmax")):
            cat = "attention"
        elif any(k in low for k in ("adam", "multi_tensor", "foreach")):
            cat = "optimizer"
        elif "norm" in low:
            cat = "norm"
        elif any(k in low for k in ("copy", "fill", "memset", "memcpy")):
            cat = "copy/fill"
        else:
            cat = "elementwise/other"
        cats[cat] += dur
        top[name] = top.get(name, 0.0) + dur
    intervals.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in intervals:
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None and cur_s is not None:
        busy += cur_e - cur_s
    window = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
    ms = 1e-3 / steps  # profiler times are microseconds
    kernels.sort()
    gaps = []
    reach = kernels[0][1] if kernels else 0.0
    for (_, _, prev_name), (s, e, name) in itertools.pairwise(kernels):
        if s - reach > 100:  # > 0.1 ms with nothing running
            gaps.append(
                {
                    "ms": (s - reach) * 1e-3,
                    "at_ms": (reach - kernels[0][0]) * 1e-3,
                    "after": prev_name[:80],
                    "before": name[:80],
                }
            )
        reach = max(reach, e)
    gaps.sort(key=lambda g: -g["ms"])
    ops: dict[str, float] = {}
    for a in prof.key_averages():
        if getattr(a, "device_type", None) == DeviceType.CUDA:
            continue
        t = float(getattr(a, "self_device_time_total", 0.0) or 0.0)
        if t > 0:
            ops[a.key] = t
    return {
        "gaps_over_0_1ms_per_step": {
            "count": len(gaps) / steps,
            "ms": sum(g["ms"] for g in gaps) / steps,
        },
        "top_gaps": gaps[:12],
        "top_ops_self_device_ms_per_step": {
            k[:80]: v * ms for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:20]
        },
        "steps": steps,
        "kernel_ms_per_step": sum(cats.values()) * ms,
        "gpu_busy_ms_per_step": busy * ms,
        "gpu_window_ms_per_step": window * ms,
        "by_category_ms_per_step": {k: v * ms for k, v in cats.items()},
        "top_kernels_ms_per_step": {
            k[:120]: v * ms for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:15]
        },
    }


def profile_steps(run_step: Any, steps: int) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            run_step(i)
        torch.cuda.synchronize()
    return kernel_summary(prof, steps)


# ----------------------------------------------------------------------------- direct child
def direct_child(spec_wire: dict[str, Any], port: int, device: str, cmd_q: Any, res_q: Any) -> None:
    """A TrainEngine in a plain process; runs step batches on command."""
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import warnings

    warnings.filterwarnings("ignore")
    try:
        import torch

        import tgapi
        from tgruntime.trainer import TrainEngine
        from tgruntime.trainer.steptime import bench_batch, matmul_tflops

        spec = tgapi.parse_spec(spec_wire, local=True)
        engine = TrainEngine.create(spec=spec, device=device)
        gcst = gc_meter()
        res_q.put(("ready", engine.mesh()))
    except BaseException:
        res_q.put(("error", traceback.format_exc()))
        return
    while True:
        cmd, arg = cmd_q.get()
        try:
            if cmd == "steps":
                first, n = arg
                rows = []
                for i in range(first, first + n):
                    batch = bench_batch(spec, i)
                    t0 = time.perf_counter()
                    r = engine.train_step(batch)
                    rows.append(
                        {"engine": r.step_time_s, "call": time.perf_counter() - t0, "loss": r.loss}
                    )
                g = gc_take(gcst)
                for row in rows:
                    row["gc_ms"] = sum(g["ms"]) / len(rows)
                    row["gc2_n"] = g["n"][2] / len(rows)
                res_q.put(("ok", rows))
            elif cmd == "variant":
                set_fusions(engine, arg)
                gc_frozen("gcfreeze" in arg)
                gc_take(gcst)  # the switch's own collection is not a step's
                res_q.put(("ok", arg))
            elif cmd == "profile":
                batches = [bench_batch(spec, 1000 + i) for i in range(arg)]
                res_q.put(("ok", profile_steps(lambda i, b=batches: engine.train_step(b[i]), arg)))
            elif cmd == "matmul":
                if device != "cuda":
                    res_q.put(("ok", {"matmul_tflops": float("nan")}))
                    continue
                res_q.put(
                    (
                        "ok",
                        {
                            "matmul_tflops": matmul_tflops(),
                            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                            "gpu_name": torch.cuda.get_device_name(),
                        },
                    )
                )
            elif cmd == "stop":
                engine.shutdown()
                res_q.put(("ok", None))
                return
        except BaseException:
            res_q.put(("error", traceback.format_exc()))


def gc_meter() -> dict[str, Any]:
    """Count Python garbage-collector pauses in this process (gc.callbacks)."""
    import gc

    st: dict[str, Any] = {"t0": 0.0, "ms": [0.0, 0.0, 0.0], "n": [0, 0, 0]}

    def cb(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            st["t0"] = time.perf_counter()
        else:
            g = int(info["generation"])
            st["ms"][g] += (time.perf_counter() - st["t0"]) * 1e3
            st["n"][g] += 1

    gc.callbacks.append(cb)
    return st


def gc_take(st: dict[str, Any]) -> dict[str, Any]:
    out = {"ms": list(st["ms"]), "n": list(st["n"])}
    st["ms"], st["n"] = [0.0, 0.0, 0.0], [0, 0, 0]
    return out


def gc_frozen(on: bool) -> None:
    """gc.freeze(): objects alive now leave the collector's generations (no more scans)."""
    import gc

    if on:
        gc.collect()
        gc.freeze()
    else:
        gc.unfreeze()


def set_fusions(engine: Any, variant: str) -> None:
    """Model-level fusions, switched at run time on the built model (same weights).

    ``eager``: none (SwiGLU as megatron's unfused glu, RoPE as megatron's unfused function);
    ``swiglu``: megatron's bias_activation_fusion (its torch.compile'd SwiGLU); ``rope``:
    megatron's unfused RoPE function through torch.compile; ``both``; anything else: the model
    as the runtime built it. The state lives on megatron's rope_utils module, so it persists
    in the process across calls.
    """
    import torch
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    st = getattr(rope_utils, "__tg_bench_state__", None)
    if st is None:
        built = rope_utils._apply_rotary_pos_emb_bshd
        eager = getattr(built, "__wrapped__", built)
        st = {"built": built, "eager": eager, "compiled": None, "cfg": {}}
        rope_utils.__tg_bench_state__ = st
    configs: list[Any] = []
    for m in engine.state.module.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, TransformerConfig) and all(cfg is not c for c in configs):
            configs.append(cfg)
            st["cfg"].setdefault(id(cfg), cfg.bias_activation_fusion)
    names = variant.split("-")
    if not ({"eager", "swiglu", "rope", "both"} & set(names)):
        for cfg in configs:
            cfg.bias_activation_fusion = st["cfg"][id(cfg)]
        rope_utils._apply_rotary_pos_emb_bshd = st["built"]
        return
    swiglu = "swiglu" in names or "both" in names
    rope = "rope" in names or "both" in names
    for cfg in configs:
        cfg.bias_activation_fusion = swiglu
    if rope and st["compiled"] is None:
        compiled = st["built"] is not st["eager"]
        st["compiled"] = st["built"] if compiled else torch.compile(st["eager"])
    rope_utils._apply_rotary_pos_emb_bshd = st["compiled"] if rope else st["eager"]


# ----------------------------------------------------------------------------- worker probes
def _install_probes(self: Any) -> str:
    """Runs inside the worker actor (via __ray_call__): time stamps around train_model."""
    import time as _t

    cls = type(self)
    engine = self.engine
    orig_step = type(engine).train_step
    orig_record = cls._record_progress
    orig_engine = cls._engine
    self._probe = []
    self._probe_progress = True
    self._probe_gc = gc_meter()

    def _engine() -> Any:
        self._probe_enter = _t.time()
        return orig_engine(self)

    def train_step(input_ids: Any) -> Any:
        t0 = _t.time()
        r = orig_step(engine, input_ids)
        t1 = _t.time()
        self._probe.append(
            {"enter": self._probe_enter, "step_in": t0, "step_out": t1, "engine": r.step_time_s}
        )
        return r

    self._probe_writes = []

    def _record_progress(**kw: Any) -> None:
        if self._probe_progress:
            orig_record(self, **kw)
            w = self._progress
            if w is not None and not getattr(w, "_probe_wrapped", False):
                orig_write = type(w)._write

                def _write(progress: Any) -> None:
                    t0 = _t.time()
                    orig_write(w, progress)
                    self._probe_writes.append((t0, _t.time() - t0))

                w._write = _write
                w._probe_wrapped = True
        if self._probe:
            self._probe[-1]["progressed"] = _t.time()

    self._engine = _engine
    engine.train_step = train_step
    self._record_progress = _record_progress
    return "ok"


def _micro_worker(self: Any, n: int) -> dict[str, Any]:
    """Inside the worker: the Python pieces of a train_model call outside the engine, and
    the progress writes seen so far (start, seconds)."""
    import statistics as _st
    import time as _t

    import ray as _ray
    import torch as _torch

    from tgapi.progress import TrainingProgress
    from tgruntime.controller import DataProto

    def t(f: Any) -> float:
        xs = []
        for _ in range(n):
            a = _t.perf_counter()
            f()
            xs.append(_t.perf_counter() - a)
        return _st.median(xs) * 1e3

    metrics = {
        "step": 1,
        "loss": 5.0,
        "grad_norm": 1.0,
        "tokens": 16384,
        "step_time_s": 0.25,
        "lr": 1e-4,
        "skipped": False,
        "rank": 0,
        "dp_rank": 0,
        "shard_loss": 5.0,
    }
    ctx = _ray._private.worker.global_worker.get_serialization_context()  # type: ignore[no-untyped-call]  # untyped in ray

    def result() -> Any:
        return DataProto.from_dict(
            tensors={"loss": _torch.tensor([5.0] * 16, dtype=_torch.float32)}, meta_info=metrics
        )

    out = result()
    writer = self._progress
    progress = TrainingProgress(
        step=1, loss=5.0, grad_norm=1.0, tokens_per_s=1.0, last_step_at=_t.time()
    )
    return {
        "result_from_dict_ms": t(result),
        "result_serialize_ms": t(lambda: ctx.serialize(out)),
        "engine_mesh_ms": t(self.engine.mesh),
        "progress_write_ms": t(lambda: writer._write(progress)) if writer else None,
        "writes": list(getattr(self, "_probe_writes", [])),
    }


def _take_probes(self: Any) -> list[dict[str, float]]:
    out: list[dict[str, float]]
    out, self._probe = self._probe, []
    g = gc_take(self._probe_gc)
    for row in out:
        row["gc_ms"] = sum(g["ms"]) / max(1, len(out))
        row["gc2_n"] = g["n"][2] / max(1, len(out))
    return out


def _set_worker_fusions(self: Any, variant: str) -> None:
    set_fusions(self.engine, variant)


def _set_gc_frozen(self: Any, on: bool) -> None:
    gc_frozen(on)
    gc_take(self._probe_gc)


def _set_progress(self: Any, on: bool) -> None:
    self._probe_progress = on


def _set_switchinterval(self: Any, value: float) -> float:
    old = sys.getswitchinterval()
    sys.setswitchinterval(value)
    return old


def _stamp(self: Any, *args: Any) -> float:
    import time as _t

    return _t.time()


def _cprofile_worker(self: Any, steps: int) -> str:
    """Python profile of train_model inside the worker (no Ray transport), top by own time."""
    import cProfile
    import io
    import pstats

    from tgruntime.controller import DataProto
    from tgruntime.trainer.steptime import bench_batch

    datas = [
        DataProto.from_dict(tensors={"input_ids": bench_batch(self.spec, 3000 + i)})
        for i in range(steps)
    ]
    prof = cProfile.Profile()
    prof.enable()
    for d in datas:
        self.train_model(d)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    return buf.getvalue()


def _profile_worker(self: Any, steps: int) -> dict[str, Any]:
    from tgruntime.controller import DataProto
    from tgruntime.trainer.steptime import bench_batch

    datas = [
        DataProto.from_dict(tensors={"input_ids": bench_batch(self.spec, 2000 + i)})
        for i in range(steps)
    ]
    return profile_steps(lambda i: self.train_model(datas[i]), steps)


# ----------------------------------------------------------------------------- driver
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="seed")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="timed steps per path per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--probe-calls", type=int, default=30)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument(
        "--variants",
        default="group,group-noprogress",
        help="comma list of: group, group-noprogress, group-switch05, group-int32, "
        "group-gcfreeze, group-eager (and -swiglu, -rope, -both)",
    )
    p.add_argument(
        "--direct-variants",
        default="direct",
        help="comma list of: direct (as built), direct-eager, direct-swiglu, direct-rope, "
        "direct-both, direct-gcfreeze",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--cpu", action="store_true", help="smoke run without a GPU (float32, gloo)")
    args = p.parse_args(argv)

    import bench_group_step
    import ray

    import bench_step
    import tgapi
    from tgapi import markers
    from tgruntime.controller import DataProto, WorkerGroup
    from tgruntime.controller.connect import connect
    from tgruntime.local.head import start_local_head, stop_local_head
    from tgruntime.trainer.launch import free_port
    from tgruntime.trainer.steptime import bench_batch, flops_per_step

    spec = bench_step.preset_spec(args.preset, gpu=not args.cpu, tp=1, world=1)
    if args.cpu:
        spec = tgapi.parse_spec(
            {**tgapi.to_wire(spec), "model": {**tgapi.to_wire(spec.model), "dtype": "float32"}},
            local=True,
        )
    name = f"ovh-{args.preset}"
    body = json.dumps(bench_group_step._resource(spec, name))
    tg = tgapi.parse_resource(json.loads(body), local=True)
    result: dict[str, Any] = {"preset": args.preset, "args": vars(args) | {"json": str(args.json)}}

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1, default=str))

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    ctx = mp.get_context("spawn")
    cmd_q, res_q = ctx.Queue(), ctx.Queue()
    child = ctx.Process(
        target=direct_child,
        args=(tgapi.to_wire(spec), free_port(), "cpu" if args.cpu else "cuda", cmd_q, res_q),
        daemon=True,
    )

    def direct(cmd: str, arg: Any = None, timeout: float = 600) -> Any:
        cmd_q.put((cmd, arg))
        status, value = res_q.get(timeout=timeout)
        if status != "ok":
            raise RuntimeError(f"direct child: {value}")
        return value

    head = start_local_head(num_cpus=4, num_gpus=0 if args.cpu else 1)
    try:
        log("direct child starting (builds its model while the server builds the group's)")
        child.start()
        t0 = time.perf_counter()
        server = bench_group_step._run(
            [
                sys.executable,
                "-m",
                "tgruntime.entrypoints.server",
                "--spec-json",
                body,
                "--address",
                head.gcs_address,
            ],
            timeout=900,
            what="server (creates the detached group, exits)",
        )
        result["server_s"] = time.perf_counter() - t0
        assert markers.parse_last(markers.GroupReady, server.stdout) is not None
        status, value = res_q.get(timeout=600)
        if status != "ok" and status != "ready":
            raise RuntimeError(f"direct child failed:\n{value}")
        log(f"group ready ({result['server_s']:.1f}s); direct ready")

        connect(address=head.gcs_address, ray_namespace=tg.ray_namespace)
        wg = WorkerGroup.attach(group_name=tg.group_name, ray_namespace=tg.ray_namespace)
        wg.get_mesh()
        handle = wg.workers[0]
        assert handle is not None  # a live group: every rank has a handle
        assert ray.get(handle.__ray_call__.remote(_install_probes)) == "ok"

        def group_steps(first: int, n: int, int32: bool = False) -> list[dict[str, float]]:
            rows = []
            for i in range(first, first + n):
                ids = bench_batch(spec, i)
                data = DataProto.from_dict(tensors={"input_ids": ids.int() if int32 else ids})
                a = time.time()
                out = wg.train_model(data)
                b = time.time()
                rows.append(
                    {"start": a, "end": b, "wall": b - a, "loss": float(out.meta_info["loss"])}
                )
            taken: list[dict[str, float]] = ray.get(handle.__ray_call__.remote(_take_probes))
            for row, pr in zip(rows, taken, strict=True):
                row.update(
                    to_worker=pr["enter"] - row["start"],
                    pre=pr["step_in"] - pr["enter"],
                    sync_in=(pr["step_out"] - pr["step_in"]) - pr["engine"],
                    engine=pr["engine"],
                    post=pr.get("progressed", pr["step_out"]) - pr["step_out"],
                    back=row["end"] - pr.get("progressed", pr["step_out"]),
                    gc_ms=pr["gc_ms"],
                    gc2_n=pr["gc2_n"],
                )
            g = gc_take(client_gc)
            for row in rows:
                row["client_gc_ms"] = sum(g["ms"]) / len(rows)
            return rows

        variants = [v for v in args.variants.split(",") if v]

        client_gc = gc_meter()

        def set_variant(v: str) -> None:
            frozen = v == "group-gcfreeze"
            ray.get(handle.__ray_call__.remote(_set_gc_frozen, frozen))
            gc_frozen(frozen)
            ray.get(handle.__ray_call__.remote(_set_progress, v != "group-noprogress"))
            ray.get(handle.__ray_call__.remote(_set_worker_fusions, v))
            gc_take(client_gc)
            ray.get(
                handle.__ray_call__.remote(
                    _set_switchinterval, 0.0005 if v == "group-switch05" else 0.005
                )
            )

        dvariants = [v for v in args.direct_variants.split(",") if v]
        if "direct" not in dvariants:
            dvariants.insert(0, "direct")
        log("warm-up (and compiles of the direct variants)")
        for v in list(dvariants):
            try:
                direct("variant", v)
                direct("steps", (0, args.warmup))
            except Exception as exc:  # a variant that does not compile here is left out
                log(f"{v} left out: {str(exc)[-1500:]}")
                result.setdefault("left_out", {})[v] = str(exc)[-3000:]
                dvariants.remove(v)
        group_steps(0, args.warmup)
        per: dict[str, list[dict[str, float]]] = {
            **{v: [] for v in dvariants},
            **{v: [] for v in variants},
        }
        for r in range(args.rounds):
            first = args.warmup + r * args.steps
            for v in dvariants:
                direct("variant", v)
                per[v] += direct("steps", (first, args.steps))
            direct("variant", "direct")
            for v in variants:
                set_variant(v)
                per[v] += group_steps(first, args.steps, int32=v == "group-int32")
            set_variant("group")
            log(
                f"round {r}: "
                + ", ".join(
                    f"{v} {med([x['engine'] for x in per[v]]) * 1e3:.1f} ms" for v in dvariants
                )
                + ", "
                + ", ".join(
                    f"{v} {med([x['wall'] for x in per[v]]) * 1e3:.1f} ms" for v in variants
                )
            )
        result["steps"] = per
        save()

        log("probes: empty call, call with the step's DataProto")
        data = DataProto.from_dict(tensors={"input_ids": bench_batch(spec, 0)})
        probes: dict[str, list[float]] = {
            "empty_rtt": [],
            "empty_oneway": [],
            "data_rtt": [],
            "data_oneway": [],
        }
        for _ in range(args.probe_calls):
            a = time.time()
            w: float = ray.get(handle.__ray_call__.remote(_stamp))
            b = time.time()
            probes["empty_rtt"].append(b - a)
            probes["empty_oneway"].append(w - a)
            a = time.time()
            w = ray.get(handle.__ray_call__.remote(_stamp, data))
            b = time.time()
            probes["data_rtt"].append(b - a)
            probes["data_oneway"].append(w - a)
        result["probes"] = probes
        save()

        try:
            result["micro_worker"] = ray.get(
                handle.__ray_call__.remote(_micro_worker, 50), timeout=120
            )
        except Exception as exc:
            result["micro_worker"] = {"error": str(exc)[-2000:]}
        save()
        log("cProfile: client around train_model, worker around train_model")
        import cProfile
        import io
        import pstats

        cprof = cProfile.Profile()
        datas = [
            DataProto.from_dict(tensors={"input_ids": bench_batch(spec, 4000 + i)})
            for i in range(3)
        ]
        cprof.enable()
        for d in datas:
            wg.train_model(d)
        cprof.disable()
        buf = io.StringIO()
        pstats.Stats(cprof, stream=buf).sort_stats("tottime").print_stats(30)
        result["cprofile_client"] = buf.getvalue()
        try:
            result["cprofile_worker"] = ray.get(
                handle.__ray_call__.remote(_cprofile_worker, 3), timeout=120
            )
        except Exception as exc:
            result["cprofile_worker"] = f"error: {exc}"[-2000:]
        save()

        log("direct: matmul rate; profiler")
        result["direct_info"] = direct("matmul")
        if args.cpu:
            args.profile_steps = 0
        try:
            if args.profile_steps:
                direct("variant", "direct")
                result["profile_direct"] = direct("profile", args.profile_steps)
                if "direct-both" in dvariants:
                    direct("variant", "direct-both")
                    result["profile_direct_both"] = direct("profile", args.profile_steps)
        except Exception as exc:  # the profile is extra: keep the timings
            result["profile_direct"] = {"error": str(exc)[-2000:]}
        direct("stop")
        try:
            if args.profile_steps:
                result["profile_group"] = ray.get(
                    handle.__ray_call__.remote(_profile_worker, args.profile_steps), timeout=300
                )
        except Exception as exc:
            result["profile_group"] = {"error": str(exc)[-2000:]}
        save()
        bench_group_step.teardown(tg, gcs_address=head.gcs_address)
    finally:
        if child.is_alive():
            child.terminate()
        stop_local_head(head)

    # ------------------------------------------------------------------ report
    flops = flops_per_step(spec)
    rate = result["direct_info"]["matmul_tflops"]  # nan on CPU
    d_med = med([x["engine"] for x in per["direct"]])
    summary: dict[str, Any] = {}
    for v in dvariants:
        m = med([x["engine"] for x in per[v]])
        summary[v] = {
            "engine_ms": m * 1e3,
            "call_ms": med([x["call"] for x in per[v]]) * 1e3,
            "gc_ms_per_step": statistics.fmean(x["gc_ms"] for x in per[v]),
            "vs_direct": d_med / m,
            "mfu": flops / m / 1e12 / rate,
        }
    phases = ["to_worker", "pre", "sync_in", "engine", "post", "back"]
    for v in variants:
        rows = per[v]
        w = med([x["wall"] for x in rows])
        summary[v] = {
            "wall_ms": w * 1e3,
            "ratio": d_med / w,
            "overhead_ms": (w - d_med) * 1e3,
            "mfu": flops / w / 1e12 / rate,
            **{f"{ph}_ms": med([x[ph] for x in rows]) * 1e3 for ph in phases},
            "worker_gc_ms_per_step": statistics.fmean(x["gc_ms"] for x in rows),
            "client_gc_ms_per_step": statistics.fmean(x["client_gc_ms"] for x in rows),
            "outside_engine_ms": med([x["wall"] - x["engine"] for x in rows]) * 1e3,
        }
    summary["probes_ms"] = {k: med(v) * 1e3 for k, v in probes.items()}
    result["summary"] = summary
    result["matmul_tflops"] = rate
    save()

    print(
        f"\n{args.preset}: {args.rounds} rounds x {args.steps} steps per path, interleaved; "
        f"medians; matmul {rate:.0f} TFLOP/s"
    )
    print(
        f"{'path':<18} {'wall ms':>8} {'ratio':>6} {'MFU':>6} "
        + " ".join(f"{ph:>9}" for ph in phases)
        + f" {'outside':>8}"
    )
    for v in dvariants:
        s = summary[v]
        print(
            f"{v:<18} {s['engine_ms']:>8.1f} {s['vs_direct']:>6.3f} {s['mfu']:>6.3f}  "
            f"(train_step call {s['call_ms']:.1f}; GC {s['gc_ms_per_step']:.2f} ms/step)"
        )
    for v in variants:
        s = summary[v]
        print(
            f"{v:<18} {s['wall_ms']:>8.1f} {s['ratio']:>6.3f} {s['mfu']:>6.3f} "
            + " ".join(f"{s[ph + '_ms']:>9.2f}" for ph in phases)
            + f" {s['outside_engine_ms']:>8.2f}  GC worker {s['worker_gc_ms_per_step']:.2f}"
            f" client {s['client_gc_ms_per_step']:.2f} ms/step"
        )
    print("probes (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in summary["probes_ms"].items()))
    micro = result.get("micro_worker", {})
    writes = micro.get("writes", [])
    if writes:
        # steps of the as-shipped group path with a progress write inside the engine step
        rows = per.get("group", [])
        hit = [r for r in rows if any(r["start"] <= w0 <= r["end"] for w0, _ in writes)]
        miss = [r for r in rows if r not in hit]
        micro["steps_with_write"] = {
            "n": len(hit),
            "engine_ms": med([r["engine"] for r in hit]) * 1e3,
            "n_without": len(miss),
            "engine_ms_without": med([r["engine"] for r in miss]) * 1e3,
            "write_ms_median": med([d for _, d in writes]) * 1e3,
            "writes": len(writes),
        }
        save()
    print(
        "worker pieces (ms): "
        + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in micro.items()
            if k != "writes"
        )
    )
    for key in ("profile_direct", "profile_direct_both", "profile_group"):
        prof = result.get(key, {})
        if "kernel_ms_per_step" in prof:
            cats = ", ".join(f"{k} {v:.1f}" for k, v in prof["by_category_ms_per_step"].items())
            print(
                f"{key}: kernels {prof['kernel_ms_per_step']:.1f} ms/step, GPU busy "
                f"{prof['gpu_busy_ms_per_step']:.1f} of {prof['gpu_window_ms_per_step']:.1f} ms;"
                f" {cats}"
            )
            print(f"  gaps > 0.1 ms: {prof['gaps_over_0_1ms_per_step']}")
        elif prof:
            print(f"{key}: {prof}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
