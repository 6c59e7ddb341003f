"""The aiohttp application: the Tinker API (SDK 0.38.0) over one trainer group: the routes of
each resource (service.routes) over one :class:`ServiceCore` (service.core says how training
work is ordered), behind one middleware: keys, errors, limits and the audit line."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from tgruntime.service import audit
from tgruntime.service.core import ServiceCore, _json_log, log
from tgruntime.service.limits import LimitError
from tgruntime.service.policy import track_admin_uses
from tgruntime.service.routes import hub
from tgruntime.service.routes.checkpoints import CheckpointRoutes
from tgruntime.service.routes.external import ExternalRoutes
from tgruntime.service.routes.futures import FutureRoutes
from tgruntime.service.routes.info import InfoRoutes
from tgruntime.service.routes.models import ModelRoutes
from tgruntime.service.routes.sampling import SamplingRoutes
from tgruntime.service.routes.sessions import SessionRoutes
from tgruntime.service.routes.sharing import SharingRoutes
from tgruntime.service.sessions import ServiceError

__all__ = ["ServiceCore", "TinkerService", "create_app"]


class TinkerService(
    SessionRoutes, ModelRoutes, SamplingRoutes, FutureRoutes, CheckpointRoutes, SharingRoutes,
    InfoRoutes, ExternalRoutes,
):
    """The whole API: the routes of each resource over one :class:`ServiceCore`."""


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    started, admin_on = time.monotonic(), track_admin_uses()  # service.policy fills it
    response = await _answer(request, handler)
    try:
        await audit.record(request, request.get("principal"), response, started, admin_on)
    except Exception as exc:  # the audit line must never fail the request
        log.warning("audit record of %s failed: %s", request.path, exc)
    return response


async def _answer(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    service: TinkerService = request.app["service"]
    path = request.path
    if path.startswith("/api/v1/") and path not in ("/api/v1/healthz",):
        who, why = service.keys.resolve(request.headers.get("X-API-Key"))
        if who is None:
            return web.json_response({"error": why, "category": "user"}, status=401)
        request["principal"] = who
    limits = service.limits
    try:
        size = request.content_length
        if size is not None and size > limits.max_body_bytes:  # refused before it is read
            raise limits.body_error(size)
        return await handler(request)
    except ServiceError as exc:
        _json_log("refused", path=path, status=exc.status, error=str(exc))
        headers = exc.headers() if isinstance(exc, LimitError) else {}
        return web.json_response(
            {"error": str(exc), "category": exc.category}, status=exc.status, headers=headers
        )
    except web.HTTPRequestEntityTooLarge:  # a body without Content-Length, read past the limit
        big = limits.body_error(None)
        _json_log("refused", path=path, status=big.status, error=str(big))
        return web.json_response({"error": str(big), "category": "user"}, status=big.status)
    except web.HTTPException:
        raise
    except Exception as exc:
        log.exception("unhandled error on %s", path)
        return web.json_response(
            {"error": f"{type(exc).__name__}: {exc}", "category": "server"}, status=500
        )


def create_app(service: TinkerService) -> web.Application:
    app = web.Application(
        middlewares=[_errors], client_max_size=service.limits.max_body_bytes
    )
    app["service"] = service
    s = service
    v1 = "/api/v1"
    post = {
        "client/config": s.client_config,
        "client/dynamic_config": s.dynamic_config,
        "create_session": s.create_session,
        "session_heartbeat": s.heartbeat,
        "sessions/{session_id}/finish": s.finish,
        "create_model": s.create_model,
        "get_info": s.get_info,
        "forward_backward": s.forward_backward,
        "optim_step": s.optim_step,
        "save_weights": s.save_weights,
        "save_weights_for_sampler": s.save_weights_for_sampler,
        "load_weights": s.load_weights,
        "create_sampling_session": s.create_sampling_session,
        "asample": s.asample,
        "retrieve_future": s.retrieve_future,
        "telemetry": s.telemetry,
        "weights_info": s.weights_info,
        "copy_weights": s.copy_weights,
        "save_weights_external": s.save_weights_external,
    }
    get = {
        "healthz": s.healthz,
        "get_server_capabilities": s.capabilities,
        "samplers/{sampler_id}": s.get_sampler,
        "training_runs": s.training_runs,
        "training_runs/{run_id}": s.training_run,
        "training_runs/{run_id}/checkpoints": s.run_checkpoints,
        "checkpoints": s.checkpoints,
    }
    for route, handler in post.items():
        app.router.add_post(f"{v1}/{route}", handler)
    for route, handler in get.items():
        app.router.add_get(f"{v1}/{route}", handler)
    one = f"{v1}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}"
    app.router.add_delete(one, s.delete_checkpoint)
    app.router.add_put(f"{one}/ttl", s.set_checkpoint_ttl)
    app.router.add_post(f"{one}/publish", s.publish_checkpoint)
    app.router.add_delete(f"{one}/publish", s.publish_checkpoint)
    s.add_sharing_routes(app)
    s.add_archive_routes(app)  # archive links of checkpoints (routes/archive.py)
    s.add_external_routes(app)  # external weights' file links (routes/external.py)
    app.router.add_get("/healthz", s.healthz)
    hub.add_routes(app, s)  # the tokenizer for HF_ENDPOINT=<base>/hf (routes/hub.py)

    async def on_startup(_: web.Application) -> None:
        s.samples.start()
        s._spawn(s._expire_loop())
        s._spawn(s._sweep_loop())  # expired checkpoints: now, then every minute
        if s.lora is not None:
            s._spawn(s._park_loop())

    async def on_cleanup(_: web.Application) -> None:
        await s.samples.stop()
        for t in list(s._tasks):
            t.cancel()
        await s.drop_own_copies()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
