"""A stand-in for the Hugging Face hub (which tests cannot reach): one directory served as one
repo over the hub's HTTP API, by the same routes the Tinker server serves its tokenizer with
(``tgruntime.service.routes.hub.RepoRoutes``), in a thread of the test process. The real
``huggingface_hub`` client downloads from it when ``HF_ENDPOINT`` names its URL.

``token``: when set, a request must carry it (``Authorization: Bearer``, as ``HF_TOKEN`` makes
``huggingface_hub`` send it); without it the repo answers 401, as the hub does for a gated or
private model. It may be changed while the hub serves."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aiohttp import web

from tgruntime.service.routes.hub import RepoRoutes, _error


class DirectoryHub(RepoRoutes):
    def __init__(self, repo: str, root: Path, *, token: str | None = None) -> None:
        super().__init__()
        self.repo, self.root, self.token = repo, root, token
        self.requests: list[str] = []

    def files(self) -> dict[str, Path]:
        return {p.name: p for p in sorted(self.root.iterdir()) if p.is_file()}

    def _check(self, request: web.Request) -> tuple[str, web.Response | None]:
        self.requests.append(f"{request.method} {request.path}")
        repo = f"{request.match_info['org']}/{request.match_info['model']}"
        if self.token is not None and request.headers.get("Authorization") != (
            f"Bearer {self.token}"
        ):
            return repo, _error(401, "GatedRepo", f"{repo} needs a token")
        if repo != self.repo:
            return repo, _error(404, "RepoNotFound", f"{repo!r} is not served here")
        return repo, self._check_revision(request, repo)


@contextmanager
def serve_hub(hub: DirectoryHub) -> Iterator[str]:
    """Serve ``hub`` on a free local port until the block ends; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    app = web.Application()
    hub.add_to(app, "")
    runner = web.AppRunner(app)
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="test-hub", daemon=True)
    thread.start()
    if not started.wait(30):
        raise RuntimeError("the test hub did not start in 30 s")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
