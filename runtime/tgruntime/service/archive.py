"""A checkpoint directory as a tar stream, written in a thread and handed to the event loop in
chunks through a bounded queue: the server holds a few MiB of it at most, whatever the
checkpoint's size.

Members are the directory's regular files and folders, named relative to it (the archive
unpacks into the folder the client picks, as ``tinker_cookbook.weights.download`` expects);
symlinks are left out, so an archive never carries a link nor anything outside the
checkpoint. The checkpoint's sidecar (TTL, metadata, readers) lives beside the directory and is
not in it."""

from __future__ import annotations

import asyncio
import tarfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path

CHUNK = 1 << 20  # bytes per chunk handed to the response
QUEUED = 4  # chunks waiting at most (the writer thread blocks beyond)


class _QueueWriter:
    """A write-only file whose bytes go to ``queue`` in ``CHUNK``-sized pieces."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[bytes | None]):
        self.loop, self.queue = loop, queue
        self.buf = bytearray()
        self.cancelled = threading.Event()

    def _put(self, item: bytes | None) -> None:
        if self.cancelled.is_set():
            raise OSError("the client went away")
        asyncio.run_coroutine_threadsafe(self.queue.put(item), self.loop).result()

    def write(self, data: bytes) -> int:
        self.buf += data
        while len(self.buf) >= CHUNK:
            self._put(bytes(self.buf[:CHUNK]))
            del self.buf[:CHUNK]
        return len(data)

    def close(self) -> None:
        if self.buf:
            self._put(bytes(self.buf))
            self.buf.clear()


def members(d: Path) -> list[Path]:
    """What the archive of ``d`` holds, parents before children: folders and regular files
    under ``d``, no symlinks (nor anything under a symlinked folder)."""
    out: list[Path] = []
    for p in sorted(d.rglob("*")):
        rel = p.relative_to(d)
        chain = [d / Path(*rel.parts[: i + 1]) for i in range(len(rel.parts))]
        if any(c.is_symlink() for c in chain):
            continue
        if p.is_dir() or p.is_file():
            out.append(p)
    return out


def write_tar(d: Path, out: _QueueWriter) -> int:
    """Write the archive of ``d`` to ``out``; the bytes of the files it holds."""
    total = 0
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for p in members(d):
            info = tar.gettarinfo(str(p), arcname=str(p.relative_to(d)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isreg():
                with p.open("rb") as f:
                    tar.addfile(info, f)
                total += info.size
            else:
                tar.addfile(info)
    out.close()
    return total


async def tar_chunks(d: Path) -> AsyncIterator[bytes]:
    """The archive of ``d``, chunk by chunk. A failure while writing (a file deleted under
    way) ends the stream with the error raised here, so the response is cut short (a
    truncated tar never reads as complete)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=QUEUED)
    writer = _QueueWriter(loop, queue)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            write_tar(d, writer)
        except BaseException as exc:  # handed to the loop, re-raised there
            failure.append(exc)
        finally:
            if not writer.cancelled.is_set():  # the end; not waited for (the reader may be gone)
                asyncio.run_coroutine_threadsafe(queue.put(None), loop)

    thread = threading.Thread(target=run, name="tg-archive", daemon=True)
    thread.start()
    try:
        while (chunk := await queue.get()) is not None:
            yield chunk
        if failure:
            raise failure[0]
    finally:
        writer.cancelled.set()
        while not queue.empty():  # unblock a writer waiting on a full queue
            queue.get_nowait()
