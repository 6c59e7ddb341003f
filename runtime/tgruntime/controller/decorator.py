"""``register``: marks worker methods as group methods, with a dispatch and execute mode.

A registered method keeps working as an ordinary method inside the worker. The wrapper
it gets does three small things on the worker side:

- materialises ``DataProtoFuture`` arguments (results of another group's non-blocking
  call) before the method runs;
- drops the padding rows the controller added to make a batch divide evenly, when the
  method returns a DataProto (or TensorDict, or list) with one row per input row;
- carries a ``MethodSpec`` that the WorkerGroup reads to bind the method.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tgruntime.controller import dispatch

# re-exported: users import them from here (verl's place); defined in modes.py
from tgruntime.controller.modes import TRIM_KWARG as TRIM_KWARG
from tgruntime.controller.modes import Dispatch as Dispatch

SPEC_ATTR = "__tg_method_spec__"

F = TypeVar("F", bound=Callable[..., Any])


class Execute(enum.Enum):
    """Which workers run the call."""

    ALL = "ALL"
    RANK_ZERO = "RANK_ZERO"


DispatchFn = Callable[..., tuple[Any, Any]]
CollectFn = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class CustomDispatch(Mapping[str, Callable[..., Any]]):
    """User-defined dispatch/collect pair (also readable as verl's dict)."""

    dispatch_fn: DispatchFn
    collect_fn: CollectFn

    def __getitem__(self, key: str) -> Callable[..., Any]:
        if key == "dispatch_fn":
            return self.dispatch_fn
        if key == "collect_fn":
            return self.collect_fn
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(("dispatch_fn", "collect_fn"))

    def __len__(self) -> int:
        return 2

    def describe(self) -> dict[str, str]:
        return {
            "dispatch_fn": _import_path(self.dispatch_fn),
            "collect_fn": _import_path(self.collect_fn),
        }


@dataclass(frozen=True)
class MeshDispatch(Mapping[str, Callable[..., Any]]):
    """Mesh-aware N-D dispatch of DataProto: split by dp rank, collect from marked ranks."""

    mesh_name: str

    def __getitem__(self, key: str) -> Callable[..., Any]:
        if key == "dispatch_fn":
            return functools.partial(dispatch.dispatch_nd_proto, self.mesh_name)
        if key == "collect_fn":
            return functools.partial(dispatch.collect_nd_proto, self.mesh_name)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(("dispatch_fn", "collect_fn"))

    def __len__(self) -> int:
        return 2


DispatchMode = Dispatch | CustomDispatch | MeshDispatch


@dataclass(frozen=True)
class MethodSpec:
    """How a registered method is dispatched, executed and collected."""

    dispatch_mode: DispatchMode
    execute_mode: Execute = Execute.ALL
    blocking: bool = True
    materialize_futures: bool = True

    def describe(self) -> dict[str, Any]:
        """JSON form, stored in the group record so attach needs no import of the class."""
        mode = self.dispatch_mode
        if isinstance(mode, Dispatch):
            dispatch: Any = mode.value
        elif isinstance(mode, MeshDispatch):
            dispatch = {"mesh": mode.mesh_name}
        else:
            dispatch = {"custom": mode.describe()}
        return {"dispatch": dispatch, "execute": self.execute_mode.value, "blocking": self.blocking}

    @classmethod
    def from_description(cls, data: Mapping[str, Any]) -> MethodSpec:
        raw = data["dispatch"]
        mode: DispatchMode
        if isinstance(raw, str):
            mode = Dispatch(raw)
        elif "mesh" in raw:
            mode = MeshDispatch(raw["mesh"])
        else:
            custom = raw["custom"]
            mode = CustomDispatch(
                dispatch_fn=_LazyImport(custom["dispatch_fn"]),
                collect_fn=_LazyImport(custom["collect_fn"]),
            )
        return cls(
            dispatch_mode=mode,
            execute_mode=Execute(data["execute"]),
            blocking=bool(data["blocking"]),
        )


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> MeshDispatch:
    """verl's mesh-aware dispatch for ``register(dispatch_mode=...)``."""
    return MeshDispatch(mesh_name)


def as_dispatch_mode(mode: Any) -> DispatchMode:
    """Accept a Dispatch, a MeshDispatch, or a {"dispatch_fn", "collect_fn"} mapping."""
    if isinstance(mode, Dispatch | CustomDispatch | MeshDispatch):
        return mode
    if isinstance(mode, Mapping):
        missing = {"dispatch_fn", "collect_fn"} - set(mode)
        if missing:
            raise ValueError(
                "a custom dispatch mode needs keys dispatch_fn and collect_fn; missing "
                f"{sorted(missing)}"
            )
        if not callable(mode["dispatch_fn"]) or not callable(mode["collect_fn"]):
            raise TypeError("dispatch_fn and collect_fn must be callables")
        return CustomDispatch(dispatch_fn=mode["dispatch_fn"], collect_fn=mode["collect_fn"])
    raise TypeError(
        f"dispatch_mode must be a Dispatch or a dict with dispatch_fn/collect_fn, not {mode!r}"
    )


def register(
    dispatch_mode: Any = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
) -> Callable[[F], F]:
    """Mark a worker method as a group method (verl's decorator, same arguments)."""
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute, not {execute_mode!r}")
    spec = MethodSpec(
        dispatch_mode=as_dispatch_mode(dispatch_mode),
        execute_mode=execute_mode,
        blocking=bool(blocking),
        materialize_futures=bool(materialize_futures),
    )

    def decorator(func: F) -> F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_inner(*args: Any, **kwargs: Any) -> Any:
                trim = kwargs.pop(TRIM_KWARG, None)
                if spec.materialize_futures:
                    args, kwargs = _materialize(args, kwargs)
                return _trim(await func(*args, **kwargs), trim)

            setattr(async_inner, SPEC_ATTR, spec)
            _expose_signature(async_inner, func)
            return async_inner  # type: ignore[return-value]

        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            trim = kwargs.pop(TRIM_KWARG, None)
            if spec.materialize_futures:
                args, kwargs = _materialize(args, kwargs)
            return _trim(func(*args, **kwargs), trim)

        setattr(inner, SPEC_ATTR, spec)
        _expose_signature(inner, func)
        return inner  # type: ignore[return-value]

    return decorator


def _expose_signature(wrapper: Any, func: Callable[..., Any]) -> None:
    """Give the wrapper the method's signature plus the controller's keyword.

    Ray validates call arguments against ``inspect.unwrap(method)``'s signature, so the
    wrapper must not point at ``func`` through ``__wrapped__`` (Ray would check against
    ``func``, which lacks the keyword).
    """
    sig = inspect.signature(func)
    params = list(sig.parameters.values())
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        params.append(inspect.Parameter(TRIM_KWARG, inspect.Parameter.KEYWORD_ONLY, default=None))
    wrapper.__signature__ = sig.replace(parameters=params)
    with contextlib.suppress(AttributeError):
        del wrapper.__wrapped__


def method_spec(obj: Any) -> MethodSpec | None:
    spec = getattr(obj, SPEC_ATTR, None)
    return spec if isinstance(spec, MethodSpec) else None


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every registered method of a worker class (including inherited ones)."""
    out: dict[str, MethodSpec] = {}
    for name in dir(cls):
        try:
            attr = inspect.getattr_static(cls, name)
        except AttributeError:
            continue
        func = attr.__func__ if isinstance(attr, staticmethod | classmethod) else attr
        spec = method_spec(func)
        if spec is not None:
            out[name] = spec
    return out


def _materialize(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    from tgruntime.controller.futures import DataProtoFuture

    if any(isinstance(a, DataProtoFuture) for a in args):
        args = tuple(a.get() if isinstance(a, DataProtoFuture) else a for a in args)
    if any(isinstance(v, DataProtoFuture) for v in kwargs.values()):
        kwargs = {k: v.get() if isinstance(v, DataProtoFuture) else v for k, v in kwargs.items()}
    return args, kwargs


def _trim(output: Any, trim: Any) -> Any:
    """Drop padding rows: ``trim`` is (real rows, padded rows) of this worker's input."""
    if not trim:
        return output
    real, padded = trim
    from tgruntime.controller.dataproto import DataProto

    if isinstance(output, DataProto) and len(output) == padded:
        return output.slice(0, real)
    if isinstance(output, list) and len(output) == padded:
        return output[:real]
    from tgruntime.controller.partition import is_tensordict

    if is_tensordict(output) and len(output.batch_size) and output.batch_size[0] == padded:
        return output[:real]
    return output


def _import_path(obj: Any) -> str:
    if isinstance(obj, _LazyImport):
        return obj.path
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(obj, functools.partial) or not module or not qualname or "<" in qualname:
        return ""
    return f"{module}:{qualname}"


class _LazyImport:
    """A callable named by ``module:qualname``, imported on first call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._target: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._target is None:
            if not self.path:
                raise RuntimeError(
                    "this method uses a custom dispatch function that cannot be imported by name "
                    "(a lambda, closure or partial); attach with cls=<the worker class> to bind it"
                )
            import importlib

            module, _, qualname = self.path.partition(":")
            target: Any = importlib.import_module(module)
            for part in qualname.split("."):
                target = getattr(target, part)
            self._target = target
        assert self._target is not None
        return self._target(*args, **kwargs)
