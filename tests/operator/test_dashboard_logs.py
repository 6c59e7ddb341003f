"""How DashboardClient.node_log_file reads Ray's three answers for a log file: the text, a
500 naming FileNotFoundError, and an empty 200 (seen for a missing file under load)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from tg_operator.dashboard import DashboardClient

FILES = {"progress.jsonl": "{\"step\": 2}\n"}


async def _logs(request: web.Request) -> web.StreamResponse:
    name = request.query["filename"]
    if name in FILES:
        return web.Response(text=FILES[name])
    if name == "empty-answer":
        return web.Response(text="")
    return web.Response(status=500, text=f"FileNotFoundError: {name} is not found")


async def _read_all(names: list[str]) -> list[str | None]:
    app = web.Application()
    app.router.add_get("/api/v0/logs/file", _logs)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            dash = DashboardClient(
                base_url=f"http://127.0.0.1:{port}", session=session, timeout_s=10
            )
            return [await dash.node_log_file(node_id="n1", filename=n) for n in names]
    finally:
        await runner.cleanup()


def test_missing_and_empty_files_read_as_none_and_text_as_text() -> None:
    got = asyncio.run(_read_all(["progress.jsonl", "absent.jsonl", "empty-answer"]))
    assert got == [FILES["progress.jsonl"], None, None]
