"""The group's tokenizer over a read-only slice of the Hugging Face Hub's HTTP API, so that
``get_tokenizer`` works on a cluster with no hub access (issue 38).

SDK 0.38's ``TrainingClient.get_tokenizer`` calls ``AutoTokenizer.from_pretrained`` on
``get_info``'s ``tokenizer_id`` (the served name, e.g. ``Qwen/Qwen3-0.6B``), and the
cookbook's ``tokenizer_utils.get_tokenizer`` does the same with the model name. Both go
through ``huggingface_hub``, which honours ``HF_ENDPOINT``. With::

    HF_ENDPOINT=$TINKER_BASE_URL/hf  HF_TOKEN=$TINKER_API_KEY

they download the group's tokenizer files from this server under the served names (the
tokenizer's files only, never weights; the key is checked like any API call). Routes:

- ``HEAD|GET /hf/{org}/{model}/resolve/{revision}/{file}``: one file, with the headers
  ``huggingface_hub`` reads (``X-Repo-Commit``, ``ETag``, ``Content-Length``);
- ``GET /hf/api/models/{org}/{model}[/revision/{revision}]``: the repo's sha and files;
- ``GET /hf/api/models/{org}/{model}/tree/{revision}``: its files, listed.

A missing file answers 404 with ``X-Error-Code: EntryNotFound`` (transformers then skips the
optional files), an unknown name ``RepoNotFound``, a revision other than ``main`` or the
commit ``RevisionNotFound``. The commit is a hash of the files' names and bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from pathlib import Path
from typing import Any

from aiohttp import web

from tgapi.model import HF_MODEL_ID
from tgruntime.service.backend import GroupInfo

PREFIX = "/hf"
FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",
)
"""The files served (those present in the tokenizer directory): never weights."""
LLAMA3_TOKENIZER = "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer"
"""The name the SDK and the cookbook load a ``meta-llama/Llama-3*`` model's tokenizer by."""


def hub_names(info: GroupInfo) -> tuple[str, ...]:
    """The ``org/model`` names the group's tokenizer is served under: the base model id and its
    aliases of that form, and the SDK's Llama 3 tokenizer name for a Llama 3 model."""
    names = [n for n in (info.base_model, *info.aliases) if re.fullmatch(HF_MODEL_ID, n)]
    if any(n.startswith("meta-llama/Llama-3") for n in names):
        names.append(LLAMA3_TOKENIZER)
    return tuple(dict.fromkeys(names))


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers={"X-Error-Code": code})


class RepoRoutes:
    """The hub's read-only HTTP API over one set of files (``files``), served under the repo
    names ``_check`` accepts: ``resolve`` (HEAD and GET of one file), ``model_info`` and
    ``tree``. A subclass says which files and who may read them."""

    def __init__(self) -> None:
        self._commit: str | None = None
        # name -> (bytes, ETag): read and hashed once, like the commit id, not on the event
        # loop at every download
        self._blobs: dict[str, tuple[bytes, str]] = {}

    def files(self) -> dict[str, Path]:
        raise NotImplementedError

    def _check(self, request: web.Request) -> tuple[str, web.Response | None]:
        """(the repo named, None) when the caller and the name are good; else an error."""
        raise NotImplementedError

    def _check_revision(self, request: web.Request, repo: str) -> web.Response | None:
        rev = request.match_info.get("revision", "main")
        if rev not in ("main", self.commit()):
            return _error(
                404, "RevisionNotFound",
                f"revision {rev!r} of {repo} is not served (main or {self.commit()})",
            )
        return None

    def commit(self) -> str:
        if self._commit is None:
            h = hashlib.sha1(usedforsecurity=False)
            for name, path in sorted(self.files().items()):
                h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
            self._commit = h.hexdigest()
        return self._commit

    def add_to(self, app: web.Application, prefix: str) -> None:
        repo = prefix + "/{org}/{model}"
        api = prefix + "/api/models/{org}/{model}"
        app.router.add_get(repo + "/resolve/{revision}/{file}", self.resolve)  # HEAD too
        app.router.add_get(api, self.model_info)
        app.router.add_get(api + "/revision/{revision}", self.model_info)
        app.router.add_get(api + "/tree/{revision}", self.tree)


    async def resolve(self, request: web.Request) -> web.StreamResponse:
        repo, err = self._check(request)
        if err is not None:
            return err
        name = request.match_info["file"]
        blob = self._blobs.get(name)
        if blob is None:
            path = self.files().get(name)
            if path is None:
                return _error(404, "EntryNotFound", f"{repo} has no file {name!r} here")
            data = await asyncio.to_thread(path.read_bytes)
            blob = self._blobs[name] = (data, f'"{hashlib.sha256(data).hexdigest()}"')
        data, etag = blob
        headers = {
            "X-Repo-Commit": self.commit(),
            "ETag": etag,
            "Content-Length": str(len(data)),
        }
        if request.method == "HEAD":
            return web.Response(status=200, headers=headers)
        return web.Response(body=data, headers=headers, content_type="application/octet-stream")

    def _listing(self) -> list[dict[str, Any]]:
        return [
            {"type": "file", "path": n, "size": p.stat().st_size, "oid": self.commit()}
            for n, p in sorted(self.files().items())
        ]

    async def model_info(self, request: web.Request) -> web.Response:
        repo, err = self._check(request)
        if err is not None:
            return err
        return web.json_response(
            {
                "id": repo,
                "modelId": repo,
                "sha": self.commit(),
                "private": True,
                "siblings": [{"rfilename": f["path"]} for f in self._listing()],
            }
        )

    async def tree(self, request: web.Request) -> web.Response:
        _, err = self._check(request)
        if err is not None:
            return err
        return web.json_response(self._listing())


class TokenizerHub(RepoRoutes):
    """The routes over one server's :class:`GroupInfo` and :class:`KeyStore`."""

    def __init__(self, service: Any) -> None:
        super().__init__()
        self.service = service

    @property
    def info(self) -> GroupInfo:
        info: GroupInfo = self.service.info
        return info

    def files(self) -> dict[str, Path]:
        d = self.info.tokenizer_id
        root = Path(d) if d else None
        if root is None or not root.is_dir():
            return {}
        return {f: root / f for f in FILES if (root / f).is_file()}

    def _check(self, request: web.Request) -> tuple[str, web.Response | None]:
        bearer = request.headers.get("Authorization", "")
        key = request.headers.get("X-API-Key") or (
            bearer[7:].strip() if bearer.lower().startswith("bearer ") else None
        )
        who, why = self.service.keys.resolve(key)
        if who is None:
            return "", _error(
                401, "Unauthorized",
                f"{why} (huggingface_hub sends HF_TOKEN: set HF_TOKEN=$TINKER_API_KEY)",
            )
        request["principal"] = who
        repo = f"{request.match_info['org']}/{request.match_info['model']}"
        if repo not in hub_names(self.info) or not self.files():
            served = ", ".join(hub_names(self.info)) if self.files() else "none"
            return repo, _error(
                404, "RepoNotFound",
                f"{repo!r} is not served here (this group's tokenizer is served as: {served}; "
                "set spec.model.name to the model's org/model id)",
            )
        return repo, self._check_revision(request, repo)


def add_routes(app: web.Application, service: Any) -> None:
    """Register the hub routes of ``service`` (app.create_app)."""
    TokenizerHub(service).add_to(app, PREFIX)
