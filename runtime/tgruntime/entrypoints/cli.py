"""tgctl: the TrainerGroup workflow on a laptop or any single machine (the embedded default).

    tgctl up -f tg.yaml            start a local Ray head if none is reachable; create the group
    tgctl status -f tg.yaml        phase and per-worker state
    tgctl train -f tg.yaml --steps 5
    tgctl down -f tg.yaml [--stop-ray]

The same TrainerGroup YAML as on Kubernetes; ``rayCluster``/``rayClusterRef`` are ignored.
``up`` runs the server entrypoint in its own process, which exits once the detached
group exists: the group outlives it, exactly as on a cluster. While it works, ``up``
reports progress (head, placement, actors, init_model) read from the GCS.

Output is for people by default; ``--json`` prints one JSON document on stdout instead
(progress and notes stay on stderr). The Ray address: ``--address``, else RAY_ADDRESS
(TG_RAY_ADDRESS still works, deprecated), else the head tgctl started.

Fast paths: ``status`` is not a Ray driver (it reads the GCS directly); ``down`` and
``train`` attach without importing the worker class (no torch/megatron for ``down``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import tgapi
from tgapi import markers
from tgruntime.controller.errors import TrainerGroupError
from tgruntime.local import cluster as local_ray

log = logging.getLogger("tgctl")


def _load(path: str) -> tgapi.TrainerGroup:
    return tgapi.load_file(path, local=True)


def _refuse_what_cannot_fit(tg: tgapi.TrainerGroup, args: argparse.Namespace) -> None:
    """CPU workers on this machine (no --address): refuse, before Ray starts, a model whose
    weights, gradients and optimizer state its memory cannot hold (tgapi.sizing)."""
    from tgapi import sizing

    if _address(args) or tg.spec.workers.use_gpu is True:
        return
    if tg.spec.workers.use_gpu == tgapi.USE_GPU_AUTO:
        gpus = args.num_gpus if args.num_gpus is not None else local_ray.detect_gpus().count
        if gpus > 0:
            return
    memory = sizing.host_memory_bytes()
    errors = sizing.host_errors(tg.spec, memory_bytes=memory) if memory else []
    if errors:
        raise tgapi.SpecErrors(errors)


def _emit_json(body: Mapping[str, Any]) -> None:
    print(json.dumps(body, sort_keys=True, default=str), flush=True)


def _address(args: argparse.Namespace) -> str | None:
    """--address, else RAY_ADDRESS (or the deprecated TG_RAY_ADDRESS), else None."""
    from tgruntime.controller.connect import address_from_env

    return args.address or address_from_env()


def _known_address(args: argparse.Namespace) -> str | None:
    """The explicit address, else the head tgctl started (None when neither is known)."""
    address = _address(args)
    if address:
        return address
    known = local_ray.load()
    return known.gcs_address if known else None


# ============================================================================ output filter
# Lines that megatron-core prints on every import when Transformer Engine / Apex are not
# installed (the CPU and stand-in images), and Megatron-FSDP's info lines: shown as one note.
# megatron-core 0.19 adds two: absl-py is not installed (a logging fallback), and GPTModel's
# deprecation, which we keep on purpose (docs/trainer.md, "GPTModel, not HybridModel").
_NOTICE = re.compile(
    r"Transformer Engine|\bApex\b|Megatron-FSDP|megatron_fsdp|^\s*warnings\.warn\("
    r"|absl\.logging is not installed|GPTModel IS DEPRECATED",
)
_RAY_CONNECT = re.compile(r"Connecting to existing Ray cluster|Connected to Ray cluster")
_OWN_INFO = re.compile(r" INFO tgruntime\.")


class ServerOutput:
    """Reads the server's stderr as it comes: keeps all of it in a log file, passes on
    what a person needs (warnings, errors, tracebacks), counts megatron's notices."""

    def __init__(self, stream: IO[str], log_path: Path, *, verbose: bool) -> None:
        self.notices = 0
        self.text: list[str] = []
        self._stream = stream
        self._log_path = log_path
        self._verbose = verbose
        self._thread = threading.Thread(target=self._pump, name="tgctl-server-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "w") as out:
            for line in self._stream:
                out.write(line)
                out.flush()
                self.text.append(line)
                if self._verbose:
                    _err(line.rstrip("\n"))
                elif _NOTICE.search(line):
                    self.notices += 1
                elif not (_RAY_CONNECT.search(line) or _OWN_INFO.search(line)):
                    _err(line.rstrip("\n"))

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)

    def note(self) -> str:
        if not self.notices:
            return ""
        return (
            "note: megatron-core runs without Transformer Engine/Apex here (its PyTorch "
            "fallbacks; GPTModel kept though deprecated, docs/trainer.md); "
            f"{self.notices} such lines hidden (--verbose shows them; full log "
            f"{self._log_path})"
        )


_err_lock = threading.Lock()


def _err(text: str) -> None:
    with _err_lock:
        print(text, file=sys.stderr, flush=True)


class Progress:
    """One line per step on stderr, each with the time since ``up`` began."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.shown: dict[str, str] = {}  # the last line shown per topic ("placement", ...)

    def step(self, text: str) -> None:
        topic = text.split(":", 1)[0]
        if self.shown.get(topic) != text:
            self.shown[topic] = text
            _err(f"[{time.monotonic() - self.t0:6.1f}s] {text}")


def _watch_creation(
    view: Any,
    tg: tgapi.TrainerGroup,
    proc: subprocess.Popen[str],
    progress: Progress,
    deadline: float,
) -> None:
    """Report placement / actors / init_model from the GCS until the server exits."""
    from tgruntime.controller.gcs_view import by_name

    n = tg.spec.world_size
    pgs = len(tg.spec.workers.processes_per_node)
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            record = view.record(group_name=tg.group_name, ray_namespace=tg.ray_namespace)
            members = view.members(group_name=tg.group_name, ray_namespace=tg.ray_namespace)
            if record is not None:
                progress.step(f"actors: {n}/{n} alive")
                progress.step("init_model: running on every worker")
            elif members is not None:
                actors = by_name(view.actors(ray_namespace=tg.ray_namespace))
                mine = [actors[w] for w in members.worker_names if w in actors]
                if not mine:
                    progress.step(
                        f"placement: waiting for {pgs} placement group(s) of {n} bundle(s)"
                    )
                else:
                    progress.step(f"placement: {pgs} placement group(s) placed")
                    alive = sum(a.state == "ALIVE" for a in mine)
                    progress.step(f"actors: {alive}/{n} alive")
            else:
                progress.step(
                    "server: connecting, checking the cluster, importing the worker class"
                )
        except TrainerGroupError:
            pass  # a slow GCS answer: the server's own result decides
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)


# ============================================================================ up
def cmd_up(args: argparse.Namespace) -> int:
    from tgruntime.controller.gcs_view import GcsView

    tg = _load(args.file)
    _refuse_what_cannot_fit(tg, args)
    progress = Progress()
    progress.step("head: looking for a Ray head")
    head = local_ray.ensure(address=_address(args), num_cpus=args.num_cpus, num_gpus=args.num_gpus)
    view = GcsView(head.gcs_address)
    dashboard = view.dashboard_url()
    progress.step(
        f"head: {head.gcs_address}"
        + (f", dashboard {dashboard}" if dashboard else " (no dashboard)")
    )
    cmd = [sys.executable, "-m", "tgruntime.entrypoints.server", "-f", args.file]
    cmd += ["--address", head.gcs_address]
    progress.step(
        f"server: creating group {tg.group_name} in Ray namespace {tg.ray_namespace} "
        f"({tg.spec.world_size} workers)"
    )
    log_path = local_ray.state_file().parent / "logs" / f"up-{tg.ray_namespace}-{tg.group_name}.log"
    timeout_s = tg.spec.timeouts.workers_ready_seconds + 120
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
    )
    assert proc.stdout is not None and proc.stderr is not None
    out_lines: list[str] = []
    reader = threading.Thread(target=lambda: out_lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    errors = ServerOutput(proc.stderr, log_path, verbose=args.verbose)
    try:
        _watch_creation(view, tg, proc, progress, deadline)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
            print(
                f"tgctl up: the server did not finish within {timeout_s:g}s "
                "(spec.timeouts.workersReadySeconds + 120 s); log: " + str(log_path),
                file=sys.stderr,
            )
            return 1
    finally:
        reader.join(timeout=10)
        errors.join(10)
    note = errors.note()
    if note:
        _err(note)
    stdout = "".join(out_lines)
    ready = markers.parse_last(markers.GroupReady, stdout)
    if proc.returncode != 0 or ready is None:
        failed = markers.parse_last(markers.GroupFailed, stdout) or markers.GroupFailed(
            error=f"server exited {proc.returncode}"
        )
        print(f"tgctl up: {failed.error}\n  (server log: {log_path})", file=sys.stderr)
        if args.json:
            body = {"ok": False, **markers.payload_to_wire(failed), "serverLog": str(log_path)}
            _emit_json(body)
        return 1
    progress.step(f"init_model: done, group {ready.group_name} is up")
    if args.json:
        wire = markers.payload_to_wire(ready)
        _emit_json({**wire, "rayAddress": head.gcs_address, "dashboardUrl": dashboard})
        return 0
    print(
        f"group {ready.group_name} is up in Ray namespace {ready.ray_namespace} "
        f"(generation {ready.generation}, mesh {dict(ready.mesh)})"
    )
    device = {"device": ready.device, "backend": ready.backend, "dtype": ready.dtype}
    print(f"  device: {describe_device(ready.use_gpu, device)}")
    for rank, name in enumerate(ready.worker_names):
        print(f"  rank {rank}: {name}")
    if dashboard:
        print(f"  Ray dashboard: {dashboard}")
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


# ============================================================================ status
def _gcs_address(address: str) -> str:
    """host:port for a driver-less GCS client ("auto": the newest head on this machine)."""
    if address.startswith("ray://"):
        raise TrainerGroupError(
            f"--address {address}: tgctl status reads the GCS directly and needs its "
            "host:port (the head's port 6379 on a RayCluster), not a ray:// client address"
        )
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address_or_die

        return str(canonicalize_bootstrap_address_or_die("auto"))
    return address


def group_status(
    address: str, tg: tgapi.TrainerGroup, *, view: Any = None, now: float | None = None
) -> dict[str, Any]:
    """The group's phase, workers and training progress, read from the GCS (no driver, no
    worker class). ``view``: a ``GcsView`` to reuse (``--watch``)."""
    from tgapi.workers import WorkerState, describe_worker
    from tgruntime.controller.gcs_view import GcsView, by_name

    if view is None:
        view = GcsView(_gcs_address(address))
    record = view.record(group_name=tg.group_name, ray_namespace=tg.ray_namespace)
    base: dict[str, Any] = {
        "groupName": tg.group_name,
        "rayNamespace": tg.ray_namespace,
        "rayAddress": view.address,
    }
    if record is None:
        members = view.members(group_name=tg.group_name, ray_namespace=tg.ray_namespace)
        phase = "Creating" if members is not None else "NotFound"
        return {**base, "phase": phase, "workers": []}
    actors = by_name(view.actors(ray_namespace=tg.ray_namespace))
    workers = []
    for rank, name in enumerate(record.worker_names):
        a = actors.get(name)
        state, cause = describe_worker(
            ray_state=a.state if a else None, death_cause=a.death_cause if a else None
        )
        pid = a.pid if a else None
        workers.append(
            {"rank": rank, "name": name, "state": str(state), "pid": pid, "cause": cause}
        )
    alive = sum(w["state"] == WorkerState.ALIVE for w in workers)
    return {
        **base,
        "phase": "Ready" if alive == len(workers) else "Degraded",
        "generation": record.generation,
        "alive": alive,
        "worldSize": len(workers),
        "mesh": dict(record.mesh),
        "useGpu": record.use_gpu,
        "device": dict(record.device),
        "training": training_status(record.training, now=time.time() if now is None else now),
        "workers": workers,
        "dashboardUrl": view.dashboard_url(),
    }


def training_status(progress: Any, *, now: float) -> dict[str, Any] | None:
    """The record's ``training`` on the wire plus ``lastStepAgeSeconds`` (None: no step yet)."""
    if progress is None:
        return None
    out: dict[str, Any] = progress.to_wire()
    out["lastStepAgeSeconds"] = round(progress.age_s(now), 3)
    return out


def describe_training(training: Mapping[str, Any] | None) -> str:
    """``step 2, loss 4.8123, 1,234 tokens/s, last step 12 s ago`` (from training_status)."""
    from tgapi.progress import describe_age

    if not training:
        return "no optimizer step recorded yet"
    parts = [f"step {training['step']}"]
    loss = training.get("loss")
    parts.append(f"loss {loss:.4f}" if loss is not None else "loss n/a")
    rate = training.get("tokensPerSecond")
    parts.append(f"{rate:,.0f} tokens/s" if rate is not None else "tokens/s n/a")
    parts.append(f"last step {describe_age(float(training.get('lastStepAgeSeconds') or 0.0))}")
    runs = int(training.get("runs", 1))
    if runs != 1:
        parts.append(f"{runs} runs")
    return ", ".join(parts)


def render_status(st: Mapping[str, Any], *, file: str) -> list[str]:
    """``tgctl status``'s text for people, from :func:`group_status` (pure)."""
    ns = st["rayNamespace"]
    if st["phase"] == "NotFound":
        return [
            "phase: NotFound",
            f"group {st['groupName']!r} is not in Ray namespace {ns!r} at {st['rayAddress']}.",
            f"Run `tgctl up -f {file}` to create it.",
        ]
    if st["phase"] == "Creating":
        return [
            f"phase: Creating  (group {st['groupName']} in Ray namespace {ns}: "
            "its workers are being created; ask again shortly)"
        ]
    lines = [
        f"phase: {st['phase']}  ({st['alive']}/{st['worldSize']} workers alive, generation "
        f"{st['generation']}, Ray namespace {ns})",
        f"device: {describe_device(st['useGpu'], st['device'])}",
        f"training: {describe_training(st.get('training'))}",
    ]
    if st["dashboardUrl"]:
        lines.append(f"dashboard: {st['dashboardUrl']}")
    lines.append(f"{'RANK':<5} {'STATE':<12} {'PID':<8} {'NAME':<40} CAUSE")
    for w in st["workers"]:
        lines.append(
            f"{w['rank']:<5} {w['state']:<12} {w['pid'] or '':<8} {w['name']:<40} {w['cause']}"
        )
    return lines


def _status_rc(st: Mapping[str, Any]) -> int:
    return {"Ready": 0, "NotFound": 1}.get(st["phase"], 3)


# Redraw in place on a terminal: back to the first line of the last frame, clear to the end.
_CLEAR_TO_END = "\x1b[J"
WATCH_MIN_S = 0.2
WATCH_MAX_S = 3600.0


def _watch_status(
    args: argparse.Namespace, tg: tgapi.TrainerGroup, address: str, interval: float
) -> int:
    """Refresh the status every ``interval`` s until Ctrl-C (exit 0)."""
    from tgruntime.controller.gcs_view import GcsView

    interval = min(max(interval, WATCH_MIN_S), WATCH_MAX_S)
    tty = sys.stdout.isatty()
    drawn = 0
    try:
        view = GcsView(_gcs_address(address))
        while True:
            st = group_status(address, tg, view=view)
            if args.json:
                _emit_json(st)  # one document per refresh (JSON lines)
            else:
                lines = render_status(st, file=args.file)
                stamp = time.strftime("%H:%M:%S")
                lines.append(f"(every {interval:g} s, {stamp}; Ctrl-C to stop)")
                if tty:
                    up = f"\x1b[{drawn}F" if drawn else ""
                    sys.stdout.write(up + _CLEAR_TO_END + "\n".join(lines) + "\n")
                    drawn = len(lines)
                else:
                    sys.stdout.write("\n".join(lines) + "\n\n")
                sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def cmd_status(args: argparse.Namespace) -> int:
    tg = _load(args.file)
    address = _known_address(args)
    if address is None:
        raise TrainerGroupError(
            "no Ray cluster is known: run `tgctl up -f FILE` first, or pass --address "
            "(or set RAY_ADDRESS)"
        )
    if args.watch is not None:
        return _watch_status(args, tg, address, args.watch)
    st = group_status(address, tg)
    if args.json:
        _emit_json(st)
    else:
        print("\n".join(render_status(st, file=args.file)))
    return _status_rc(st)


# ============================================================================ train, down
def cmd_train(args: argparse.Namespace) -> int:
    from tgruntime.entrypoints import client_job as client

    address = _known_address(args)
    if address is None:
        print(
            "tgctl train: no Ray cluster is known: run `tgctl up -f FILE` first, or pass "
            "--address (or set RAY_ADDRESS)",
            file=sys.stderr,
        )
        return 1
    argv = ["-f", args.file, "--steps", str(args.steps), "--address", address]
    argv += ["--format", "tagged" if args.json else "human"]
    if args.fresh_batches:
        argv.append("--fresh-batches")
    if args.save_checkpoint:
        argv += ["--save-checkpoint", args.save_checkpoint]
    if args.no_progress:
        argv.append("--no-progress")
    return client.main(argv)


def describe_teardown(body: markers.Teardown) -> list[str]:
    """The teardown report in words: what was removed, checked, not checked; complete or not."""
    lines = [
        f"group {body.group_name} (Ray namespace {body.ray_namespace}): "
        f"{len(body.actors_killed)} worker(s) killed, "
        f"{len(body.placement_groups_removed)} placement group(s) removed, "
        f"{len(body.keys_removed)} key(s) deleted"
    ]
    if not (body.actors_killed or body.placement_groups_removed or body.keys_removed):
        lines[0] += " (nothing was left)"
    lines += [f"  checked: {c}" for c in body.checked]
    lines += [f"  NOT checked: {c}" for c in body.not_checked]
    if body.complete:
        lines.append("complete: everything checked is gone")
    else:
        lines.append("INCOMPLETE: " + ("; ".join(body.errors) or "see above"))
    return lines


def cmd_down(args: argparse.Namespace) -> int:
    from tgruntime.entrypoints import teardown

    tg = _load(args.file)
    address = _known_address(args)
    rc = 0
    out: dict[str, Any] = {"groupName": tg.group_name, "rayNamespace": tg.ray_namespace}
    if address is None:
        out["teardown"] = None
        if not args.json:
            print("tgctl down: no Ray cluster is known; nothing to tear down")
    else:
        body = teardown.run(
            group=tg.group_name,
            ray_namespace=tg.ray_namespace,
            address=address,
            timeout_s=args.timeout,
        )
        out["teardown"] = markers.payload_to_wire(body)
        if not body.complete:
            rc = teardown.EXIT_INCOMPLETE
            print(f"tgctl down: {teardown.incomplete_message(body)}", file=sys.stderr)
        if not args.json:
            print("\n".join(describe_teardown(body)))
    if args.stop_ray:
        if address is not None:
            _disconnect()
        stopped = local_ray.stop()
        out["stoppedLocalHead"] = stopped
        if not args.json:
            print(
                "stopped the local Ray head"
                if stopped
                else "no local Ray head started by tgctl to stop"
            )
    if args.json:
        _emit_json(out)
    return rc


def _disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


# ============================================================================ serve
def tinker_key(group: str) -> tuple[str, str]:
    """(key, where it is): TG_TINKER_API_KEY, else a ``tml-`` key generated once and stored
    0600 under the cache directory (``~/.cache/trainergroup/tinker/<group>.key``)."""
    import secrets

    env = os.environ.get("TG_TINKER_API_KEY", "").strip()
    if env:
        return env, "the TG_TINKER_API_KEY environment variable"
    path = local_ray.state_file().parent / "tinker" / f"{group}.key"
    if path.is_file():
        key = path.read_text(encoding="utf-8").strip()
        if key:
            return key, str(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = "tml-" + secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(key + "\n")
    return key, str(path)


def serve_checkpoint_dir(args: argparse.Namespace, tg: Any) -> str:
    """Where ``tgctl serve`` keeps Tinker checkpoints: ``--checkpoint-dir``, else the spec's
    ``training.checkpointDir``, else ``~/.cache/trainergroup/checkpoints/<group>``
    (``$XDG_CACHE_HOME`` honoured): a local group's workers share this machine's disk, so
    save_state works without a spec change."""
    chosen = getattr(args, "checkpoint_dir", None) or tg.spec.training.checkpoint_dir
    if chosen:
        return str(chosen)
    return str(local_ray.state_file().parent / "checkpoints" / tg.group_name)


def cmd_serve(args: argparse.Namespace) -> int:
    from tgruntime.driver.trainer_client import TrainerClient
    from tgruntime.service import policy, tls
    from tgruntime.service.__main__ import group_info, serve
    from tgruntime.service.auth import KeyStore
    from tgruntime.service.limits import from_args

    try:
        access, tls_files = policy.from_args(args), tls.from_args(args)
    except ValueError as exc:
        print(f"tgctl serve: {exc}", file=sys.stderr)
        return 2
    tg = _load(args.file)
    address = _known_address(args)
    if address is None:
        print(
            "tgctl serve: no Ray cluster is known: run `tgctl up -f FILE` first, or pass "
            "--address (or set RAY_ADDRESS)",
            file=sys.stderr,
        )
        return 1
    client = TrainerClient.connect_local(
        group_name=tg.group_name, ray_namespace=tg.ray_namespace, address=address
    )
    key, where = tinker_key(tg.group_name)
    ckpt = serve_checkpoint_dir(args, tg)
    info = group_info(
        tg.name, tg.spec, eos_token_ids=tuple(args.eos_token_id), checkpoint_dir=ckpt
    )
    keys = KeyStore(keys=[key], keys_file=args.keys_file)  # the generated key: principal default
    running = serve(
        client, info, keys, host=args.host, port=args.port, limits=from_args(args),
        policy=access, tls=tls_files,
    )
    out = {
        "baseUrl": running.url, "keyFile": where, "baseModel": info.base_model,
        "checkpointDir": ckpt, "eosTokenIds": list(info.eos_token_ids),
    }
    if args.json:
        _emit_json(out)
    else:
        print(f"base URL: {running.url}  (TINKER_BASE_URL)")
        print(f"key: {where}  (TINKER_API_KEY)")
        print(f"base model: {info.base_model}")
        print(f"checkpoints: {ckpt}")
        print(f"EOS ids (stop=None): {list(info.eos_token_ids) or 'none'}")
        if info.tokenizer_name and info.tokenizer_name != info.tokenizer_id:
            print(f"tokenizer: HF_ENDPOINT={running.url}/hf HF_TOKEN=<key>  (offline)")
    sys.stdout.flush()
    return running.serve_foreground()


def cmd_gateway(args: argparse.Namespace) -> int:
    from tgruntime.gateway.__main__ import run

    return run(args, prog="tgctl gateway")


# ============================================================================ main
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
            default=None,
            help="an existing Ray cluster's GCS address (default: RAY_ADDRESS, else the "
            "local head tgctl started; TG_RAY_ADDRESS is read too, deprecated)",
        )
        sp.add_argument("--json", action="store_true", help="one JSON document on stdout")
        sp.add_argument("-v", "--verbose", action="store_true", help="all log lines, unfiltered")
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
        'without NVIDIA GPUs). workers.useGpu "auto" (the default) then picks GPU or CPU '
        "workers from what the head has",
    )
    st = add("status", "show the group's phase, workers and training progress")
    st.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2; bounded to 0.2..3600) until Ctrl-C: redrawn "
        "in place on a terminal, reprinted otherwise; with --json one document per refresh",
    )
    tr = add("train", "attach and train")
    tr.add_argument("--steps", type=int, default=5)
    tr.add_argument("--fresh-batches", action="store_true", help="a new random batch every step")
    tr.add_argument("--save-checkpoint", default=None)
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    sv = add("serve", "serve the Tinker API for the group (docs/tinker.md)")
    sv.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    sv.add_argument(
        "--host", default="127.0.0.1", help="listen address (default loopback only)"
    )
    sv.add_argument(
        "--eos-token-id", type=int, action="append", default=[],
        help="EOS for stop=None (default: read from the tokenizer: its eos_token_id and "
        "generation_config.json's)",
    )
    sv.add_argument(
        "--keys-file",
        default=None,
        help="more keys, one principal each: 'NAME KEY' lines (# comments); re-read on change",
    )
    sv.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where save_state/save_weights_for_sampler write (default: the spec's "
        "training.checkpointDir, else ~/.cache/trainergroup/checkpoints/<group>)",
    )
    from tgruntime.service.limits import add_flags

    add_flags(sv)  # quotas and limits (docs/tinker.md)
    from tgruntime.service import policy, tls

    policy.add_flags(sv)  # --admin-principals (docs/security.md)
    tls.add_flags(sv)  # --tls-cert, --tls-key
    gw = sub.add_parser(
        "gateway", help="one Tinker endpoint for several groups' servers (docs/tinker.md)"
    )
    from tgruntime.gateway.__main__ import add_flags as gateway_flags

    gateway_flags(gw)  # --group [NAME=]URL ... | --config FILE, --host, --port, timeouts
    gw.add_argument("--json", action="store_true", help="one JSON document on stdout")
    gw.add_argument("-v", "--verbose", action="store_true", help="all log lines, unfiltered")
    dn = add("down", "tear the group down")
    dn.add_argument(
        "--stop-ray", action="store_true", help="also stop the local Ray head tgctl started"
    )
    dn.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the workers to be gone"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        if args.verbose
        else "tgctl: %(message)s",
    )
    handlers = {
        "up": cmd_up,
        "status": cmd_status,
        "train": cmd_train,
        "serve": cmd_serve,
        "gateway": cmd_gateway,
        "down": cmd_down,
    }
    try:
        return handlers[args.command](args)
    except tgapi.SpecErrors as exc:
        print(f"tgctl {args.command}: {exc}", file=sys.stderr)
        return 2
    except (TrainerGroupError, ValueError) as exc:
        print(f"tgctl {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
