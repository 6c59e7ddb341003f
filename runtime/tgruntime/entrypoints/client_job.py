"""Client entrypoint: attach to a running group and train.

    python -m tgruntime.entrypoints.client_job -f tg.yaml --steps 5
    tg-client --group tiny --ray-namespace tg-default-tiny --steps 5
    tg-client --trainergroup tiny --k8s-namespace default --steps 5  # k8s status
    tg-client wait --trainergroup tiny --print-address   # wait for Ready only

(``tg-client`` is ``python -m tgruntime.entrypoints.client_job``.)

Attaches by group name (never by hard-coded worker names, though ``--worker-names`` is
accepted), sends one batch per step through ``train_model`` and prints one
``TG_STEP {json}`` line per step (loss, grad norm, tokens/s; ``--format human``: a line
for people instead) with a progress bar on stderr; step lines are written through the
bar, so the two never garble each other on a terminal. Exits non-zero with a clear
message on failure.

Attaching imports neither the worker class nor megatron (``gcs_view.use_light_handles``).
In a pod, ``--k8s-namespace`` defaults to the pod's own Kubernetes namespace (its service
account's). ``wait`` watches the TrainerGroup until it is Ready and prints its Ray address
(``--json``: address, Ray namespace, group and worker names); it exits 1 with the status's
message when the group is Failed, not found or not Ready in time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import tgapi
from tgapi import markers
from tgruntime.controller.errors import TrainerGroupError
from tgruntime.driver import batches

if TYPE_CHECKING:
    from tgruntime.controller import WorkerGroup

log = logging.getLogger("tgruntime.entrypoints.client_job")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """Where the group is and what batches it expects."""

    group_name: str
    ray_namespace: str
    address: str | None
    spec: tgapi.TrainerGroupSpec | None
    worker_names: tuple[str, ...] = ()


def resolve_target(args: argparse.Namespace) -> Target:
    if args.file:
        tg = tgapi.load_file(args.file, local=True)
        return Target(
            group_name=tg.group_name,
            ray_namespace=tg.ray_namespace,
            address=args.address,
            spec=tg.spec,
        )
    if args.trainergroup:
        # The Kubernetes client is only needed in this mode; import lazily.
        from tgapi.kube_view import attach_target, wait_for_ready

        status, spec = wait_for_ready(
            name=args.trainergroup,
            k8s_namespace=args.k8s_namespace,
            kubeconfig=args.kubeconfig,
            timeout_s=args.wait,
        )
        where = attach_target(status, name=args.trainergroup, address=args.address)
        return Target(
            group_name=where.group_name,
            ray_namespace=where.ray_namespace,
            address=where.ray_address,
            spec=spec,
            worker_names=where.worker_names,
        )
    if not (args.group or args.worker_names) or not args.ray_namespace:
        raise ValueError(
            "say which group: -f tg.yaml, --trainergroup NAME, or --group NAME --ray-namespace NS"
        )
    return Target(
        group_name=args.group or "",
        ray_namespace=args.ray_namespace,
        address=args.address,
        spec=None,
        worker_names=tuple(args.worker_names.split(",")) if args.worker_names else (),
    )


def attach(target: Target, *, timeout_s: float) -> WorkerGroup:
    from tgruntime.controller import WorkerGroup

    if target.worker_names and not target.group_name:
        return WorkerGroup.from_worker_names(
            worker_names=list(target.worker_names), ray_namespace=target.ray_namespace
        )
    return WorkerGroup.attach(
        group_name=target.group_name, ray_namespace=target.ray_namespace, timeout_s=timeout_s
    )


def batch_stream(
    args: argparse.Namespace, spec: tgapi.TrainerGroupSpec | None
) -> Iterator[np.ndarray]:
    vocab = args.vocab_size or (spec.model.vocab_size if spec else None)
    bsz = args.batch_size or (spec.training.batch_size if spec else None)
    seq = args.seq_len or (spec.training.sequence_length if spec else None)
    if vocab is None or bsz is None or seq is None:
        raise ValueError(
            "without a spec (-f or --trainergroup) pass --vocab-size, --batch-size and --seq-len"
        )
    if args.tokens_file:
        return batches.file_batches(
            path=Path(args.tokens_file), vocab_size=vocab, batch_size=bsz, sequence_length=seq
        )
    if args.fresh_batches:
        return batches.random_batches(
            vocab_size=vocab, batch_size=bsz, sequence_length=seq, seed=args.seed
        )
    return batches.repeated_batch(
        vocab_size=vocab, batch_size=bsz, sequence_length=seq, seed=args.seed
    )


def _metric(meta: dict[str, Any], key: str, default: float = math.nan) -> float:
    value = meta.get(key, default)
    if isinstance(value, list | tuple):
        value = value[0] if value else default
    return float(value)


def train_step(wg: WorkerGroup, tokens: np.ndarray, *, step: int) -> markers.Step:
    import torch

    from tgruntime.controller import DataProto

    data = DataProto.from_dict(tensors={"input_ids": torch.from_numpy(tokens)})
    t0 = time.perf_counter()
    out = wg.train_model(data)
    wall = time.perf_counter() - t0
    per_sample = out.batch["loss"].float()
    meta = dict(out.meta_info)
    tp_losses = tuple(float(x) for x in meta.get("tp_losses", ()))
    ntok = int(tokens.size)
    return markers.Step(
        step=step,
        loss=float(per_sample.mean()),
        grad_norm=_metric(meta, "grad_norm"),
        tokens=ntok,
        step_time_s=wall,
        tokens_per_s=ntok / wall if wall > 0 else math.nan,
        tp_losses=tp_losses,
        optimizer_step=int(_metric(meta, "step", -1.0)),
    )


def human_step(report: markers.Step, steps: int) -> str:
    return (
        f"step {report.step}/{steps}: loss {report.loss:.4f}, grad norm {report.grad_norm:.3f}, "
        f"{report.tokens_per_s:,.0f} tokens/s, {report.step_time_s:.3f} s"
    )


def train(
    wg: WorkerGroup,
    stream: Iterator[np.ndarray],
    *,
    steps: int,
    progress: bool = True,
    fmt: str = "tagged",
) -> list[markers.Step]:
    from tqdm import tqdm

    reports: list[markers.Step] = []
    bar = tqdm(
        total=steps,
        desc=f"train {wg.group_name}",
        unit="step",
        file=sys.stderr,
        disable=not progress,
    )
    for step in range(1, steps + 1):
        report = train_step(wg, next(stream), step=step)
        reports.append(report)
        line = (
            human_step(report, steps)
            if fmt == "human"
            else markers.line(report)
        )
        # Through the bar: it clears itself, writes the line, redraws below it.
        bar.write(line, file=sys.stdout)
        sys.stdout.flush()
        bar.set_postfix(loss=f"{report.loss:.4f}")
        bar.update(1)
    bar.close()
    return reports


SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def add_k8s_arguments(p: argparse.ArgumentParser, *, timeout_flag: str) -> None:
    """--trainergroup, --k8s-namespace, --kubeconfig and the Ready timeout flag."""
    p.add_argument(
        "--trainergroup", help="read the target from this TrainerGroup's Kubernetes status"
    )
    p.add_argument(
        "--k8s-namespace",
        default=None,
        help="Kubernetes namespace of --trainergroup (default: this pod's namespace, from "
        f"{SERVICE_ACCOUNT_NAMESPACE}; outside a pod the kubeconfig context's, else 'default')",
    )
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig (default: in-cluster, then ~/.kube/config)"
    )
    p.add_argument(
        timeout_flag,
        dest="wait",
        type=float,
        default=None,
        help="seconds to wait for the TrainerGroup to be Ready (default: its Ready deadline, "
        "spec.timeouts clusterReadySeconds + workersReadySeconds)",
    )


def build_wait_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tg-client wait",
        description="Wait (a watch) until a TrainerGroup is Ready; print its Ray address.",
    )
    add_k8s_arguments(p, timeout_flag="--timeout")
    p.add_argument(
        "--print-address",
        action="store_true",
        help="print status.rayAddress on stdout when Ready (the default output)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print {rayAddress, rayNamespace, groupName, workerNames} as one JSON line instead",
    )
    return p


def wait_main(argv: list[str]) -> int:
    """``tg-client wait``: exit 0 and print the address when Ready, 1 with the cause if not."""
    from tgapi.kube_view import attach_target, wait_for_ready

    args = build_wait_parser().parse_args(argv)
    if not args.trainergroup:
        print("tg-client wait: --trainergroup NAME is required", file=sys.stderr)
        return 2

    def progress(st: tgapi.TrainerGroupStatus) -> None:
        print(
            f"TrainerGroup {args.trainergroup}: {st.phase or 'Pending'} {st.message}".rstrip(),
            file=sys.stderr,
        )

    try:
        status, _ = wait_for_ready(
            name=args.trainergroup,
            k8s_namespace=args.k8s_namespace,
            kubeconfig=args.kubeconfig,
            timeout_s=args.wait,
            on_progress=progress,
        )
    except (LookupError, RuntimeError, TimeoutError, PermissionError) as exc:
        print(f"tg-client wait: {exc}", file=sys.stderr)
        return 1
    where = attach_target(status, name=args.trainergroup)
    if not where.ray_address:
        print(
            f"tg-client wait: TrainerGroup {args.trainergroup} is Ready but its "
            "status.rayAddress is empty",
            file=sys.stderr,
        )
        return 1
    if args.json:
        out = {
            "rayAddress": where.ray_address,
            "rayNamespace": where.ray_namespace,
            "groupName": where.group_name,
            "workerNames": list(where.worker_names),
        }
        print(json.dumps(out))
    else:
        print(where.ray_address)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tg-client",
        description=__doc__.splitlines()[0],
        epilog="subcommand: `tg-client wait --trainergroup NAME --print-address` "
        "(--help there)",
    )
    p.add_argument("-f", "--file", help="TrainerGroup YAML (local mode)")
    add_k8s_arguments(p, timeout_flag="--wait")
    p.add_argument("--group", help="group name in the Ray namespace")
    p.add_argument("--ray-namespace", help="Ray namespace of the group")
    p.add_argument(
        "--worker-names", help="comma-separated worker names (verl's from_detached style)"
    )
    p.add_argument(
        "--address",
        default=None,
        help="Ray address (default: status.rayAddress, RAY_ADDRESS or auto; TG_RAY_ADDRESS "
        "is read too, deprecated)",
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--tokens-file", default=None, help=".npy or whitespace-separated token ids")
    p.add_argument(
        "--fresh-batches",
        action="store_true",
        help="a new random batch each step (default: one batch, memorised)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--save-checkpoint", default=None, help="directory to save a checkpoint to after training"
    )
    p.add_argument("--attach-timeout", type=float, default=30.0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--format",
        choices=("tagged", "human"),
        default="tagged",
        help="step lines: TG_STEP {json} (for machines, the default) or for people",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["wait"]:
        return wait_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        print("tg-client: --steps must be at least 1", file=sys.stderr)
        return 2
    # Here, not at the top: `wait` (the client Job's first step) needs neither Ray nor torch
    # (tensordict): a process that only watches the TrainerGroup starts in ~1 CPU s, not ~10.
    from tgruntime.controller.connect import connect
    from tgruntime.controller.gcs_view import use_light_handles

    try:
        target = resolve_target(args)
        quiet: dict[str, Any] = {"logging_level": logging.WARNING} if args.format == "human" else {}
        connect(address=target.address, ray_namespace=target.ray_namespace, **quiet)
        t0 = time.perf_counter()
        use_light_handles()
        wg = attach(target, timeout_s=args.attach_timeout)
        log.info(
            "attached to %s (%d workers) in %.1f ms: %s",
            wg.group_name,
            wg.world_size,
            (time.perf_counter() - t0) * 1e3,
            json.dumps(list(wg.worker_names)),
        )
        reports = train(
            wg,
            batch_stream(args, target.spec),
            steps=args.steps,
            # A bar only on a terminal: in a log file its redraws are noise.
            progress=not args.no_progress and sys.stderr.isatty(),
            fmt=args.format,
        )
        if args.save_checkpoint:
            wg.save_checkpoint(args.save_checkpoint)
            log.info("checkpoint saved to %s", args.save_checkpoint)
    except (
        tgapi.SpecErrors,
        ValueError,
        LookupError,
        RuntimeError,
        TrainerGroupError,
        TimeoutError,
        PermissionError,
    ) as exc:
        print(f"tg-client: {exc}", file=sys.stderr)
        return 1
    first, last = reports[0].loss, reports[-1].loss
    log.info("trained %d steps: loss %.4f -> %.4f", len(reports), first, last)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
