"""An async client for the Ray dashboard's REST APIs (Jobs and State).

The operator reaches Ray only through these endpoints, so it never imports Ray:

* Jobs API: ``POST /api/jobs/``, ``GET /api/jobs/{id}``, ``GET /api/jobs/{id}/logs``,
  ``POST /api/jobs/{id}/stop``, ``DELETE /api/jobs/{id}``;
* State API: ``GET /api/v0/actors`` filtered on ``ray_namespace``; ``GET /api/v0/logs/file``:
  a file under a node's Ray log directory (the trainer's progress file);
* ``GET /api/version`` as a reachability probe; ``GET /api/v0/nodes``: the worker nodes Ray sees.

Every request has a timeout. A dashboard that cannot be reached raises
:class:`DashboardUnreachable`; one that answers with an error raises
:class:`DashboardRequestFailed` with the status and the body's first line.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from tgapi.workers import death_cause_text

TERMINAL_JOB_STATES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
STATE_API_LIMIT = 10000


class DashboardError(Exception):
    """A request to a Ray dashboard did not succeed."""

    def __init__(self, *, url: str, message: str) -> None:
        super().__init__(f"{message} ({url})")
        self.url = url
        self.message = message


class DashboardUnreachable(DashboardError):
    """The dashboard did not answer (refused, DNS, timeout)."""


class DashboardRequestFailed(DashboardError):
    """The dashboard answered with an error status."""

    def __init__(self, *, url: str, status: int, body: str) -> None:
        first = _first_meaningful_line(body)
        hint = (
            " (this Ray dashboard uses token authentication: give the operator the token "
            "with TG_RAY_AUTH_TOKEN or TG_RAY_AUTH_TOKEN_FILE)"
            if status in (401, 403)
            else ""
        )
        super().__init__(url=url, message=f"HTTP {status}: {first}{hint}")
        self.status = status
        self.body = body


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobInfo:
    """What the Jobs API says about one submission."""

    submission_id: str
    status: str
    message: str = ""
    entrypoint: str = ""
    start_time_ms: int | None = None
    end_time_ms: int | None = None
    driver_exit_code: int | None = None
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_JOB_STATES

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> JobInfo:
        return cls(
            submission_id=str(data.get("submission_id") or ""),
            status=str(data.get("status") or "PENDING"),
            message=str(data.get("message") or ""),
            entrypoint=str(data.get("entrypoint") or ""),
            start_time_ms=_opt_int(data.get("start_time")),
            end_time_ms=_opt_int(data.get("end_time")),
            driver_exit_code=_opt_int(data.get("driver_exit_code")),
            metadata=dict(data.get("metadata") or {}),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActorInfo:
    """One actor as the State API lists it (``detail=true``)."""

    actor_id: str
    name: str
    state: str
    ray_namespace: str = ""
    class_name: str = ""
    pid: int = 0
    node_id: str = ""
    death_cause: str = ""
    start_time_ms: int = 0

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ActorInfo:
        return cls(
            actor_id=str(data.get("actor_id") or ""),
            name=str(data.get("name") or ""),
            state=str(data.get("state") or "UNKNOWN"),
            ray_namespace=str(data.get("ray_namespace") or ""),
            class_name=str(data.get("class_name") or ""),
            pid=_opt_int(data.get("pid")) or 0,
            node_id=str(data.get("node_id") or ""),
            death_cause=describe_death_cause(data.get("death_cause")),
            start_time_ms=_opt_int(data.get("start_time")) or 0,
        )


def describe_death_cause(cause: Any) -> str:
    """A one-line reason from the State API's nested ``death_cause`` (empty if none): the
    summary ``tgctl status`` prints too (``tgapi.workers``)."""
    return str(death_cause_text(cause))


class DashboardClient:
    """Talks to one Ray dashboard (``base_url`` like ``http://host:8265``)."""

    def __init__(
        self,
        *,
        base_url: str,
        session: aiohttp.ClientSession,
        timeout_s: float = 10.0,
        token: str = "",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        # Ray's token authentication: "Authorization: Bearer <token>".
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    # -- plumbing -------------------------------------------------------------------
    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: list[tuple[str, str]] | None = None,
        ok_missing: bool = False,
    ) -> tuple[int, str]:
        url = f"{self.base_url}{path}"
        try:
            async with self._session.request(
                method,
                url,
                json=json_body,
                params=params,
                timeout=self._timeout,
                headers=self._headers,
            ) as resp:
                text = await resp.text()
                if resp.status == 404 and ok_missing:
                    return resp.status, text
                if resp.status >= 400:
                    raise DashboardRequestFailed(url=url, status=resp.status, body=text)
                return resp.status, text
        except TimeoutError as exc:
            raise DashboardUnreachable(
                url=url, message=f"no answer within {self._timeout.total:g}s"
            ) from exc
        except aiohttp.ClientConnectionError as exc:
            raise DashboardUnreachable(url=url, message=f"cannot connect: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise DashboardUnreachable(url=url, message=f"request failed: {exc}") from exc

    def _json(self, path: str, text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError as exc:
            raise DashboardError(
                url=f"{self.base_url}{path}",
                message=f"answered with something that is not JSON: {text[:200]!r}",
            ) from exc

    # -- probe ----------------------------------------------------------------------
    async def version(self) -> dict[str, Any]:
        """``GET /api/version``: cheap proof that the dashboard is up."""
        path = "/api/version"
        _, text = await self._request("GET", path)
        data = self._json(path, text)
        return dict(data) if isinstance(data, Mapping) else {"raw": data}

    async def alive_worker_nodes(self) -> int:
        """``GET /api/v0/nodes``: how many ALIVE nodes other than the head the GCS knows."""
        path = "/api/v0/nodes"
        params = [("limit", str(STATE_API_LIMIT)), ("detail", "true")]
        _, text = await self._request("GET", path, params=params)
        data = self._json(path, text)
        rows = _state_rows(data)
        if rows is None:
            raise DashboardError(
                url=f"{self.base_url}{path}", message=f"State API error: {str(data)[:200]}"
            )
        return sum(
            1
            for r in rows
            if isinstance(r, Mapping) and r.get("state") == "ALIVE" and not r.get("is_head_node")
        )

    # -- Jobs API -------------------------------------------------------------------
    async def get_job(self, submission_id: str) -> JobInfo | None:
        """The job's info, or None when no job has this submission id."""
        path = f"/api/jobs/{submission_id}"
        status, text = await self._request("GET", path, ok_missing=True)
        if status == 404:
            return None
        data = self._json(path, text)
        if not isinstance(data, Mapping):
            raise DashboardError(url=f"{self.base_url}{path}", message="unexpected job info")
        info = JobInfo.from_wire(data)
        if not info.submission_id:
            info = dataclasses.replace(info, submission_id=submission_id)
        return info

    async def submit_job(
        self,
        *,
        submission_id: str,
        entrypoint: str,
        runtime_env: Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> bool:
        """Submit a job; True if created, False if a job with this id already existed."""
        body: dict[str, Any] = {"entrypoint": entrypoint, "submission_id": submission_id}
        if runtime_env:
            body["runtime_env"] = dict(runtime_env)
        if metadata:
            body["metadata"] = dict(metadata)
        try:
            await self._request("POST", "/api/jobs/", json_body=body)
        except DashboardRequestFailed as exc:
            # Ray answers a duplicate id with 400, 409 or a wrapped 500 (versions differ).
            if "already exists" in exc.body:
                return False
            raise
        return True

    async def stop_job(self, submission_id: str) -> bool:
        """Ask Ray to stop a job; False when there is no such job."""
        path = f"/api/jobs/{submission_id}/stop"
        status, _ = await self._request("POST", path, ok_missing=True)
        return status != 404

    async def delete_job(self, submission_id: str) -> bool:
        """Delete a terminal job's record; False when there is no such job."""
        path = f"/api/jobs/{submission_id}"
        status, _ = await self._request("DELETE", path, ok_missing=True)
        return status != 404

    async def job_logs(self, submission_id: str) -> str:
        path = f"/api/jobs/{submission_id}/logs"
        _, text = await self._request("GET", path)
        data = self._json(path, text)
        logs = data.get("logs") if isinstance(data, Mapping) else None
        return str(logs or "")

    # -- State API ------------------------------------------------------------------
    async def list_actors(self, *, ray_namespace: str) -> list[ActorInfo]:
        """All actors (alive and dead) in one Ray namespace."""
        path = "/api/v0/actors"
        params = [
            ("limit", str(STATE_API_LIMIT)),
            ("detail", "true"),
            ("filter_keys", "ray_namespace"),
            ("filter_predicates", "="),
            ("filter_values", ray_namespace),
        ]
        _, text = await self._request("GET", path, params=params)
        data = self._json(path, text)
        rows = _state_rows(data)
        if rows is None:
            msg = data.get("msg") if isinstance(data, Mapping) else None
            raise DashboardError(
                url=f"{self.base_url}{path}",
                message=f"State API error: {msg or str(data)[:200]}",
            )
        return [ActorInfo.from_wire(r) for r in rows if isinstance(r, Mapping)]


    async def node_log_file(self, *, node_id: str, filename: str, lines: int = 5) -> str | None:
        """The last ``lines`` lines of ``filename`` (relative to the Ray log directory) on
        node ``node_id``; None when the node has no such file or it is empty. Ray answers a
        missing file with a 500 naming FileNotFoundError, or (seen under load, CI 21:39) with
        an empty 200: both read as "nothing there yet"."""
        path = "/api/v0/logs/file"
        params = [("node_id", node_id), ("filename", filename), ("lines", str(lines))]
        try:
            _, text = await self._request("GET", path, params=params)
        except DashboardRequestFailed as exc:
            if "not found" in exc.body.lower() or "FileNotFoundError" in exc.body:
                return None
            raise
        return text or None


def _state_rows(data: Any) -> list[Any] | None:
    """The rows of a State API list reply: ``{"data": {"result": {"result": [...]}}}``."""
    if not isinstance(data, Mapping) or data.get("result") is False:
        return None
    inner = data.get("data", {})
    inner = inner.get("result", inner) if isinstance(inner, Mapping) else inner
    rows = inner.get("result") if isinstance(inner, Mapping) else inner
    return list(rows) if isinstance(rows, list) else None


def _opt_int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _first_meaningful_line(text: str) -> str:
    """The last non-empty line of a traceback, or the first line of a message."""
    lines = [ln.strip() for ln in text.strip().splitlines() if any(c.isalnum() for c in ln)]
    if not lines:
        return "(empty body)"
    if lines[0].startswith("Traceback"):
        return lines[-1][:500]
    return lines[0][:500]
