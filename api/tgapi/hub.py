"""``spec.model.pretrained`` as a Hugging Face hub id (``org/model``): the checkpoint is
downloaded where the spec is parsed with its files (``parse_spec(local=True)``: the server job
on the head, the Tinker server, each worker), into ``huggingface_hub``'s cache.

The download is ``huggingface_hub.snapshot_download`` (imported here only when a hub id is
used: tgapi itself stays standard library only). It honours ``HF_ENDPOINT`` (a mirror),
``HF_HOME`` (the cache: point it at a volume to download once per volume instead of once per
pod) and ``HF_TOKEN`` (a gated or private model; the operator sets it from
``spec.model.hubTokenSecret``). ``weights=False`` fetches the config and tokenizer only (the
parse and the Tinker server need no weights); the workers fetch the weights too. Each process
downloads a snapshot once; the cache's file locks let the ranks of a node share one download.
"""

from __future__ import annotations

import functools
import re

from tgapi.errors import PicklableError
from tgapi.model import HF_MODEL_ID

__all__ = ["HubError", "hub_dir", "is_hub_id", "local_dir"]
META_FILES = ("config.json", "generation_config.json", "*token*", "*.model", "vocab.*",
              "merges.txt", "chat_template.*", "special_tokens_map.json")
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")


class HubError(PicklableError, ValueError):
    """The hub id could not be downloaded: ``problem`` says why, ``fix`` what to do."""

    def __init__(self, *, problem: str, fix: str) -> None:
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}. Fix: {fix}")


def is_hub_id(pretrained: str | None) -> bool:
    return pretrained is not None and re.fullmatch(HF_MODEL_ID, pretrained) is not None


@functools.lru_cache(maxsize=16)
def hub_dir(repo_id: str, *, weights: bool) -> str:
    """The local snapshot directory of ``repo_id`` (downloaded now if needed)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError
    except ImportError as exc:  # pragma: no cover - the runtime image has it (transformers)
        raise HubError(
            problem=f"{repo_id!r} is a hub id, but huggingface_hub is not installed here",
            fix="install it, or point spec.model.pretrained at a directory",
        ) from exc
    patterns = [*META_FILES, *(WEIGHT_FILES if weights else ())]
    try:
        return str(snapshot_download(repo_id, allow_patterns=patterns))
    except GatedRepoError as exc:
        raise HubError(
            problem=f"the hub refused to download {repo_id!r} ({type(exc).__name__}: a gated "
            "model)",
            fix="accept its licence on the hub and put a token that did so in a Secret named by "
            "spec.model.hubTokenSecret (key: token)",
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            problem=f"{repo_id!r} is not on the hub, or is private",
            fix="check the id, or set spec.model.hubTokenSecret to a Secret (key: token) whose "
            "token can read it",
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise HubError(
            problem=f"{repo_id!r} could not be downloaded from the hub ({exc})",
            fix="the pods need the hub (or a mirror in HF_ENDPOINT); on a cluster without it, "
            "copy the checkpoint to a volume and set spec.model.pretrained to its directory",
        ) from None


def local_dir(pretrained: str, *, weights: bool = False) -> str:
    """``pretrained`` as a directory here: a directory as it is, a hub id downloaded."""
    return hub_dir(pretrained, weights=weights) if is_hub_id(pretrained) else pretrained
