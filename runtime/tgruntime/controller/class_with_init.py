"""ClassWithInitArgs: a worker class, its constructor arguments and its Ray actor options.

Accepts a plain class or one already wrapped by ``ray.remote`` (verl's examples pass
``@ray.remote`` classes); the plain class is kept so its registered methods can be read,
and the wrapper's options (e.g. ``@ray.remote(num_cpus=...)``) are carried over.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import ray

from tgruntime.controller.naming import ray_class_name

_REMOTE_CLASSES: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()


def unwrap_actor_class(cls: Any) -> tuple[type, dict[str, Any]]:
    """(plain class, default actor options) of a class or a ``ray.remote`` class."""
    meta = getattr(cls, "__ray_metadata__", None)
    if meta is not None:
        inner = getattr(meta, "modified_class", None)
        plain = getattr(inner, "__ray_actor_class__", inner)
        if isinstance(plain, type):
            return plain, dict(getattr(cls, "_default_options", {}) or {})
    if isinstance(cls, type):
        return cls, {}
    raise TypeError(f"expected a class or a ray.remote class, got {cls!r}")


class ClassWithInitArgs:
    """A worker class with its constructor arguments and actor options."""

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        plain, defaults = unwrap_actor_class(cls)
        self.cls: type = plain
        self.args: tuple[Any, ...] = args
        self.kwargs: dict[str, Any] = kwargs
        self._remote_defaults: dict[str, Any] = defaults
        self._options: dict[str, Any] = {}

    @property
    def options(self) -> dict[str, Any]:
        """Options given with update_options (they override the resource pool's)."""
        return dict(self._options)

    @property
    def remote_defaults(self) -> dict[str, Any]:
        """Options of a ``@ray.remote(...)`` wrapper (the resource pool overrides these)."""
        return dict(self._remote_defaults)

    def update_options(self, options: Mapping[str, Any]) -> None:
        """Merge Ray actor options (e.g. runtime_env, max_concurrency) into the defaults."""
        self._options.update(options)

    @property
    def class_name(self) -> str:
        return ray_class_name(self.cls)

    @property
    def import_path(self) -> str:
        return f"{self.cls.__module__}:{self.cls.__qualname__}"

    def remote_class(self) -> Any:
        """``ray.remote(cls)`` (cached on the class, so Ray exports it once)."""
        cached = _REMOTE_CLASSES.get(self.cls)
        if cached is None:
            cached = ray.remote(self.cls)
            _REMOTE_CLASSES[self.cls] = cached
        return cached

    def __repr__(self) -> str:
        return f"ClassWithInitArgs({self.import_path}, args={self.args!r}, kwargs={self.kwargs!r})"
