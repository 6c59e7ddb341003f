"""``connect`` lets the driver pass task arguments up to 1 MiB inline (Ray's
``max_direct_call_object_size``; 100 KiB by default), unless the environment chose a size."""

from __future__ import annotations

import os

import pytest

from tgruntime.controller import connect as connect_mod

ENV = connect_mod._INLINE_ENV


def test_default_is_one_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ENV == "RAY_max_direct_call_object_size"  # Ray's variable for that setting
    monkeypatch.delenv(ENV, raising=False)
    connect_mod.inline_small_arguments()
    assert os.environ[ENV] == str(1 << 20)


def test_a_size_set_in_the_environment_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "4096")
    connect_mod.inline_small_arguments()
    assert os.environ[ENV] == "4096"
