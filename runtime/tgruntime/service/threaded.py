"""An aiohttp application served on its own event loop in a thread: the Tinker server's and
the gateway's ``Running`` (``tgctl serve``/``tgctl gateway`` in the foreground, and tests)
are this with their own application, name and, for the server, TLS."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ssl
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Self, TypeVar

if TYPE_CHECKING:
    from aiohttp import web

T = TypeVar("T")


class ThreadedApp:
    """Subclasses give :meth:`_runner` (the application, set up) and may hook
    :meth:`_started`; ``what`` names the server in start errors."""

    what = "the server"

    def __init__(self, *, host: str, port: int, thread_name: str) -> None:
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=thread_name, daemon=True)

    def _ssl(self) -> ssl.SSLContext | None:
        return None

    @property
    def url(self) -> str:
        return f"{'https' if self._ssl_on() else 'http'}://{self.host}:{self.port}"

    def _ssl_on(self) -> bool:
        return False

    async def _runner(self) -> web.AppRunner:
        raise NotImplementedError

    async def _started(self, ctx: ssl.SSLContext | None) -> None:
        """Called on the loop once the site listens (the server's TLS reload)."""

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        from aiohttp import web

        runner = await self._runner()
        ctx = self._ssl()
        site = web.TCPSite(runner, self.host, self.port, ssl_context=ctx)
        await site.start()
        await self._started(ctx)
        sockets = getattr(getattr(site, "_server", None), "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        self._stop = asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the server's event loop (from another thread); its future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def start(self, timeout_s: float = 300.0) -> Self:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"{self.what} did not start within {timeout_s:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"{self.what} failed to start: {self._error}") from self._error
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)

    def wait(self) -> None:
        while self._thread.is_alive():
            self._thread.join(1.0)

    def serve_foreground(self) -> int:
        """Serve until the thread ends or Ctrl-C (then stop); the command's exit status."""
        try:
            self.wait()
        except KeyboardInterrupt:
            self.stop()
        return 0
