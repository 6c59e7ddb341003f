"""Print where the time of an end-to-end run went, and save it as timeline.json.

    python3 tests/e2e/timeline.py ARTIFACTS_DIR

Reads what tests/e2e/run.sh leaves in ARTIFACTS_DIR: ``stamps.env`` (``name=epoch`` lines
taken by the script), ``snapshot-ready.json`` (the TrainerGroup, its RayCluster, its pods and
its events, saved when it first turned Ready) and ``mem-used-mib.txt`` (the machine's used
memory, sampled every 5 s). Standard library only: it runs with the host's python3.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any


def _docs(path: Path) -> list[dict[str, Any]]:
    """The JSON documents concatenated in ``path`` (kubectl prints one per call)."""
    if not path.exists():
        return []
    text, dec, out, i = path.read_text(), json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = dec.raw_decode(text, i)
        out.append(doc)
    return out


def _t(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.UTC
    ).timestamp()


def _items(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for d in docs:
        if d.get("kind") == kind:
            found.append(d)
        elif d.get("kind") == "List" or "items" in d:
            found.extend(i for i in d.get("items", []) if i.get("kind", kind) == kind)
    return found


def _pod_condition(pod: dict[str, Any], ctype: str) -> float | None:
    for c in pod.get("status", {}).get("conditions", []):
        if c.get("type") == ctype and c.get("status") == "True":
            return _t(c.get("lastTransitionTime"))
    return None


def _first_event(events: list[dict[str, Any]], reason: str) -> float | None:
    times = [
        _t(e.get("firstTimestamp") or ((e.get("eventTime") or "")[:19] + "Z").lstrip("Z"))
        for e in events
        if e.get("reason") == reason
    ]
    return min((t for t in times if t is not None), default=None)


def timeline(artifacts: Path) -> dict[str, Any]:
    stamps: dict[str, float] = {}
    for line in (artifacts / "stamps.env").read_text().splitlines():
        name, _, value = line.partition("=")
        stamps.setdefault(name, float(value))  # first stamp wins (run_client is called twice)

    def span(a: str, b: str) -> float | None:
        return stamps[b] - stamps[a] if a in stamps and b in stamps else None

    out: dict[str, Any] = {
        "images_s": span("start", "images"),
        "cluster_create_s": span("images", "cluster"),
        "image_load_s": span("cluster", "loaded"),
        "helm_installs_s": span("loaded", "installed"),
        "apply_to_ready_s": span("applied", "ready"),
        "client_job_s": span("client_start", "client_done"),
        "worker_kill_to_degraded_s": span("kill_worker", "degraded"),
        "worker_kill_to_ready_s": span("kill_worker", "recovered"),
        "tls_phase_s": span("tls_start", "tls_done"),
        "delete_to_gone_s": span("delete", "deleted"),
        "total_s": span("start", "deleted"),
    }
    docs = _docs(artifacts / "snapshot-ready.json")
    applied = stamps.get("applied")
    pods = _items(docs, "Pod")
    events = _items(docs, "Event")
    if pods and applied:
        scheduled = [_pod_condition(p, "PodScheduled") for p in pods]
        started = [
            _t(s.get("state", {}).get("running", {}).get("startedAt"))
            for p in pods
            for s in p.get("status", {}).get("containerStatuses", [])
        ]
        ready = [_pod_condition(p, "Ready") for p in pods]
        last = {
            k: max((x for x in v if x is not None), default=None)
            for k, v in (("scheduled", scheduled), ("started", started), ("ready", ready))
        }
        submitted = _first_event(events, "ServerSubmitted")
        tg_ready = stamps.get("ready")
        if last["scheduled"]:
            out["ready_split_scheduling_s"] = last["scheduled"] - applied
        if last["scheduled"] and last["started"]:
            out["ready_split_container_start_s"] = last["started"] - last["scheduled"]
        if last["started"] and last["ready"]:
            out["ready_split_ray_up_s"] = last["ready"] - last["started"]
        if submitted and tg_ready:
            out["ready_split_server_job_s"] = tg_ready - submitted
        if last["ready"] and submitted:
            out["ready_split_operator_notice_s"] = submitted - last["ready"]
    mem = [int(x) for x in (artifacts / "mem-used-mib.txt").read_text().split()] if (
        artifacts / "mem-used-mib.txt"
    ).exists() else []
    out["machine_peak_mem_used_mib"] = max(mem, default=None)
    return out


def main() -> int:
    artifacts = Path(sys.argv[1])
    result = timeline(artifacts)
    (artifacts / "timeline.json").write_text(json.dumps(result, indent=2) + "\n")
    width = max(len(k) for k in result)
    print(f"{'what':<{width}}  value")
    for k, v in result.items():
        shown = "-" if v is None else (f"{v:.0f}" if isinstance(v, float) else str(v))
        print(f"{k:<{width}}  {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
