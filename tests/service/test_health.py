"""healthz follows the group: 200 while the attached group is current, 503 once it is not.

The real half runs against the session's served group; the stale half swaps the group's
published record (the registry is the only input of ``Backend.staleness``) for a record of
another generation, then puts it back.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.megatron]


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_healthz_is_ok_for_the_current_group(served: dict[str, Any]) -> None:
    status, body = _get(served["url"] + "/healthz")
    assert (status, body) == (200, {"status": "ok"})


def test_healthz_says_stale_once_the_group_is_re_created(served: dict[str, Any]) -> None:
    from tgruntime.controller import registry

    group = served["client"].group
    record = registry.load_record(group_name=group.group_name, ray_namespace=group.ray_namespace)
    assert record is not None
    registry.publish_record(dataclasses.replace(record, generation=record.generation + 1))
    try:
        status, body = _get(served["url"] + "/healthz")
        assert status == 503 and body["status"] == "stale"
        assert "re-created" in body["error"] and group.group_name in body["error"]
    finally:
        registry.publish_record(record)
    assert _get(served["url"] + "/healthz")[0] == 200
