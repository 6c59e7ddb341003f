"""The expression language the spec's cross-field rules are written in (``tgapi.rules``,
``tgapi.sizing``), with two back ends:

* :meth:`Expr.eval` evaluates an expression in Python over the spec's wire form (camelCase,
  defaults filled in, as ``tgapi.wire.to_wire`` writes it);
* :meth:`Expr.cel` writes it as CEL, which ``crd.py`` puts into the CRD's
  ``x-kubernetes-validations`` and the ValidatingAdmissionPolicy.

``eval`` follows CEL's semantics where they differ from Python's: ``&&``/``||``
absorb an error when the other side decides the result, ``==`` is false across
types (``true != 1``, ``"auto" != true``), integer ``/`` and ``%`` truncate toward
zero, and ``string(true)`` is ``"true"``. ``tests/api/test_rules.py`` evaluates the
generated CEL with cel-python on many specs and checks it agrees with ``eval``.

Integers are CEL's int64; :meth:`Expr.to_double` turns one into a double, whose
``+ - * /`` and comparisons ``eval`` does with Python floats (the same IEEE 754 doubles);
a :class:`Text` hole shows an integer with ``%d``, a string with ``%s`` (:class:`Str`,
:class:`Format`) and a double with ``%.<n>f`` (:class:`Fixed`), so CEL's ``format()`` and
Python write the same characters. A :class:`Var` is a named value, ``variables.<name>`` in
the admission policy.

The language knows nothing of the TrainerGroup: the spec's fields and the rules are in
``tgapi.rules``. It imports nothing from tgapi but ``tgapi.errors``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from tgapi.errors import PicklableError

Wire = Mapping[str, Any]
"""A spec in its wire form (the object under ``.spec``), defaults applied."""


class CelError(PicklableError):
    """What CEL would report as an evaluation error (no such key, division by zero)."""


class Expr:
    """An expression over the spec (``self`` in CEL)."""

    def cel(self, root: str = "self") -> str:
        raise NotImplementedError

    def eval(self, spec: Wire) -> Any:
        raise NotImplementedError

    # -- builders (Python operators where they read naturally; eq/ne as methods so that
    # expressions stay hashable and `==` keeps its usual meaning) ----------------------
    def __add__(self, other: object) -> Expr:
        return Bin("+", self, lit(other))

    def __sub__(self, other: object) -> Expr:
        return Bin("-", self, lit(other))

    def __mul__(self, other: object) -> Expr:
        return Bin("*", self, lit(other))

    def __rmul__(self, other: object) -> Expr:
        return Bin("*", lit(other), self)

    def __floordiv__(self, other: object) -> Expr:
        return Bin("/", self, lit(other))

    def __truediv__(self, other: object) -> Expr:
        """``/`` of doubles (CEL's ``/`` too: ``//`` is for integers)."""
        return Bin("/", self, lit(other))

    def __mod__(self, other: object) -> Expr:
        return Bin("%", self, lit(other))

    def __lt__(self, other: object) -> Expr:
        return Bin("<", self, lit(other))

    def __le__(self, other: object) -> Expr:
        return Bin("<=", self, lit(other))

    def __gt__(self, other: object) -> Expr:
        return Bin(">", self, lit(other))

    def __ge__(self, other: object) -> Expr:
        return Bin(">=", self, lit(other))

    def __and__(self, other: object) -> Expr:
        return Bin("&&", self, lit(other))

    def __or__(self, other: object) -> Expr:
        return Bin("||", self, lit(other))

    def __invert__(self) -> Expr:
        return Not(self)

    def eq(self, other: object) -> Expr:
        return Bin("==", self, lit(other))

    def ne(self, other: object) -> Expr:
        return Bin("!=", self, lit(other))

    def sum(self) -> Expr:
        """Sum of a list of integers (the Kubernetes CEL list library's ``sum()``)."""
        return Call("sum", self)

    def max(self) -> Expr:
        """Largest item of a non-empty list of integers (the list library's ``max()``)."""
        return Call("max", self)

    def size(self) -> Expr:
        return Call("size", self)

    def to_double(self) -> Expr:
        """``double(x)``: an integer as a double (products beyond int64 stay finite)."""
        return Convert("double", self)

    def to_int(self) -> Expr:
        """``int(x)``: a double truncated toward zero (an error outside int64)."""
        return Convert("int", self)

    # -- how a Text hole shows the value: %d by default -----------------------------------
    def verb(self) -> str:
        return "%d"

    def hole(self, spec: Wire) -> str:
        return _cel_string(self.eval(spec))

    def exists_above(self, bound: object) -> Expr:
        """Whether any item of a list is greater than ``bound``."""
        return Pick("exists", self, lit(bound))

    def first_above(self, bound: object) -> Expr:
        """The first item of a list greater than ``bound`` (an error when none is)."""
        return Pick("first", self, lit(bound))

    def exists_not_multiple_of(self, k: object) -> Expr:
        """Whether any item of a list of integers is not a multiple of ``k``."""
        return Pick("exists", self, lit(k), test="%")

    def first_not_multiple_of(self, k: object) -> Expr:
        """The first item of a list not a multiple of ``k`` (an error when none is)."""
        return Pick("first", self, lit(k), test="%")

    def exists_key_in(self, key: str, values: tuple[str, ...]) -> Expr:
        """Whether any object of a list has ``key`` equal to one of ``values``."""
        return KeyIn("exists", self, key, values)

    def first_key_in(self, key: str, values: tuple[str, ...]) -> Expr:
        """``key`` of the first object of a list whose ``key`` is one of ``values``."""
        return KeyIn("first", self, key, values)

    def within(self, directory: object) -> Expr:
        """Whether this path is ``directory`` or under it, with no ``..`` step."""
        return Within(self, lit(directory))


def lit(value: object) -> Expr:
    return value if isinstance(value, Expr) else Lit(value)


@dataclasses.dataclass(frozen=True, eq=False)
class Lit(Expr):
    value: object

    def cel(self, root: str = "self") -> str:
        v = self.value
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return str(v)
        if isinstance(v, float):
            text = repr(v)
            if v != v or v in (float("inf"), float("-inf")):
                raise TypeError(f"no CEL literal for {v!r}")
            return text if any(c in text for c in ".e") else text + ".0"
        if isinstance(v, str):
            return json.dumps(v)
        raise TypeError(f"no CEL literal for {v!r}")

    def eval(self, spec: Wire) -> Any:
        return self.value


@dataclasses.dataclass(frozen=True, eq=False)
class Field(Expr):
    """A field of the spec by its wire path, e.g. ``model.ffnHiddenSize``."""

    path: str

    def cel(self, root: str = "self") -> str:
        return f"{root}.{self.path}"

    def eval(self, spec: Wire) -> Any:
        node: Any = spec
        for key in self.path.split("."):
            if not isinstance(node, Mapping) or node.get(key) is None:
                raise CelError(f"no such key: {key}")
            node = node[key]
        return node


@dataclasses.dataclass(frozen=True, eq=False)
class Has(Expr):
    """``has(self.<path>)``: the field is set (only the last step may be absent)."""

    path: str

    def cel(self, root: str = "self") -> str:
        return f"has({root}.{self.path})"

    def eval(self, spec: Wire) -> Any:
        parent, _, key = self.path.rpartition(".")
        node = Field(parent).eval(spec) if parent else spec
        if not isinstance(node, Mapping):
            raise CelError(f"has() on a non-object at {parent}")
        return node.get(key) is not None


def _cel_eq(a: Any, b: Any) -> bool:
    # CEL's heterogeneous equality: values of different kinds are never equal
    # (bool is its own kind, not an int as in Python); int and double compare by value.
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if isinstance(a, str) != isinstance(b, str):
        return False
    return bool(a == b)


def _ints(op: str, a: Any, b: Any) -> tuple[int, int]:
    if (
        not (isinstance(a, int) and isinstance(b, int))
        or isinstance(a, bool)
        or isinstance(b, bool)
    ):
        raise CelError(f"no such overload: {type(a).__name__} {op} {type(b).__name__}")
    return a, b


def _doubles(a: Any, b: Any) -> bool:
    return isinstance(a, float) and isinstance(b, float)


def _double_op(op: str, a: float, b: float) -> Any:
    # CEL's doubles are IEEE 754 as Python's floats: x / 0.0 is an infinity, not an error.
    if op == "/":
        if b != 0:
            return a / b
        return math.nan if a == 0 or a != a else math.copysign(math.inf, a) * math.copysign(1, b)
    if op == "%":
        raise CelError("no such overload: double % double")
    return _ARITH[op](a, b)  # type: ignore[arg-type]


def _div(a: int, b: int) -> int:
    if b == 0:
        raise CelError("division by zero")
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _mod(a: int, b: int) -> int:
    if b == 0:
        raise CelError("modulus by zero")
    return a - b * _div(a, b)


_ARITH: dict[str, Callable[[int, int], Any]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": _div,
    "%": _mod,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}


def truth(value: Any) -> bool:
    if not isinstance(value, bool):
        raise CelError(f"expected a bool, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class Bin(Expr):
    op: str
    left: Expr
    right: Expr

    def cel(self, root: str = "self") -> str:
        return f"({self.left.cel(root)} {self.op} {self.right.cel(root)})"

    def eval(self, spec: Wire) -> Any:
        if self.op in ("&&", "||"):
            return self._logic(spec)
        a, b = self.left.eval(spec), self.right.eval(spec)
        if self.op == "==":
            return _cel_eq(a, b)
        if self.op == "!=":
            return not _cel_eq(a, b)
        if _doubles(a, b):
            return _double_op(self.op, a, b)
        return _ARITH[self.op](*_ints(self.op, a, b))

    def _logic(self, spec: Wire) -> bool:
        # CEL's commutative && and ||: the side that decides wins over an error on the other.
        decisive = self.op == "||"
        try:
            left: bool | CelError = truth(self.left.eval(spec))
        except CelError as e:
            left = e
        if left is decisive:
            return decisive
        right = truth(self.right.eval(spec))
        if right is decisive:
            return decisive
        if isinstance(left, CelError):
            raise left
        return right


@dataclasses.dataclass(frozen=True, eq=False)
class Not(Expr):
    inner: Expr

    def cel(self, root: str = "self") -> str:
        return f"!{self.inner.cel(root)}"

    def eval(self, spec: Wire) -> Any:
        return not truth(self.inner.eval(spec))


@dataclasses.dataclass(frozen=True, eq=False)
class Cond(Expr):
    """``test ? then : otherwise``."""

    test: Expr
    then: Expr
    otherwise: Expr

    def cel(self, root: str = "self") -> str:
        return f"({self.test.cel(root)} ? {self.then.cel(root)} : {self.otherwise.cel(root)})"

    def eval(self, spec: Wire) -> Any:
        return self.then.eval(spec) if truth(self.test.eval(spec)) else self.otherwise.eval(spec)

    def verb(self) -> str:
        if self.then.verb() != self.otherwise.verb():
            raise TypeError(f"{self.cel()}: the branches are shown differently")
        return self.then.verb()

    def hole(self, spec: Wire) -> str:
        chosen = self.then if truth(self.test.eval(spec)) else self.otherwise
        return chosen.hole(spec)


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise CelError(f"expected a list, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class Call(Expr):
    """``size(x)``, ``x.sum()`` or ``x.max()``."""

    fn: str
    arg: Expr

    def cel(self, root: str = "self") -> str:
        return (
            f"size({self.arg.cel(root)})"
            if self.fn == "size"
            else f"{self.arg.cel(root)}.{self.fn}()"
        )

    def eval(self, spec: Wire) -> Any:
        items = _list(self.arg.eval(spec))
        if self.fn == "size":
            return len(items)
        numbers = [_ints(self.fn, 0, n)[1] for n in items]
        if self.fn == "max":
            if not numbers:
                raise CelError("max() of an empty list")
            return max(numbers)
        return sum(numbers)


@dataclasses.dataclass(frozen=True, eq=False)
class Pick(Expr):
    """``l.exists(n, n > b)`` or ``l.filter(n, n > b)[0]``; with ``test`` "%", the items
    that are not multiples of ``b`` (``n % b != 0``) instead of those above it."""

    how: str
    items: Expr
    bound: Expr
    test: str = ">"

    def _test_cel(self, bound: str) -> str:
        return f"n % {bound} != 0" if self.test == "%" else f"n > {bound}"

    def _picked(self, n: Any, bound: Any) -> bool:
        if self.test == "%":
            return bool(_mod(*_ints("%", n, bound)) != 0)
        return bool(_ARITH[">"](*_ints(">", n, bound)))

    def cel(self, root: str = "self") -> str:
        items, bound = self.items.cel(root), self.bound.cel(root)
        if self.how == "exists":
            return f"{items}.exists(n, {self._test_cel(bound)})"
        return f"{items}.filter(n, {self._test_cel(bound)})[0]"

    def eval(self, spec: Wire) -> Any:
        bound = self.bound.eval(spec)
        over = [n for n in _list(self.items.eval(spec)) if self._picked(n, bound)]
        if self.how == "exists":
            return bool(over)
        if not over:
            raise CelError("index out of bounds: 0")
        return over[0]


@dataclasses.dataclass(frozen=True, eq=False)
class KeyIn(Expr):
    """``l.exists(x, x.key in [...])`` or ``l.filter(x, x.key in [...])[0].key``."""

    how: str
    items: Expr
    key: str
    values: tuple[str, ...]

    def cel(self, root: str = "self") -> str:
        values = ", ".join(json.dumps(v) for v in self.values)
        test = f"x.{self.key} in [{values}]"
        items = self.items.cel(root)
        if self.how == "exists":
            return f"{items}.exists(x, {test})"
        return f"{items}.filter(x, {test})[0].{self.key}"

    def eval(self, spec: Wire) -> Any:
        picked = []
        for item in _list(self.items.eval(spec)):
            if not isinstance(item, dict) or self.key not in item:
                raise CelError(f"no such key: {self.key}")
            if item[self.key] in self.values:
                picked.append(item[self.key])
        if self.how == "exists":
            return bool(picked)
        if not picked:
            raise CelError("index out of bounds: 0")
        return picked[0]


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise CelError(f"expected a string, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class Within(Expr):
    """``path == dir || path.startsWith(dir + "/")``, and no ``/..`` in ``path``."""

    path: Expr
    directory: Expr

    def cel(self, root: str = "self") -> str:
        p, d = self.path.cel(root), self.directory.cel(root)
        return f'(({p} == {d} || {p}.startsWith({d} + "/")) && !{p}.contains("/.."))'

    def eval(self, spec: Wire) -> Any:
        p, d = _str(self.path.eval(spec)), _str(self.directory.eval(spec))
        return (p == d or p.startswith(d + "/")) and "/.." not in p


@dataclasses.dataclass(frozen=True, eq=False)
class Convert(Expr):
    """``double(x)`` (of an integer) or ``int(x)`` (of a double, truncated toward zero)."""

    to: str
    arg: Expr

    def cel(self, root: str = "self") -> str:
        return f"{self.to}({self.arg.cel(root)})"

    def eval(self, spec: Wire) -> Any:
        value = self.arg.eval(spec)
        if self.to == "double":
            return float(_ints("double", 0, value)[1])
        if not isinstance(value, float):
            raise CelError(f"no such overload: int({type(value).__name__})")
        if not -(2.0**63) <= value < 2.0**63:
            raise CelError("double out of int64 range")
        return int(value)


@dataclasses.dataclass(frozen=True, eq=False)
class Fixed(Expr):
    """A double as a Text hole with ``digits`` decimals (``%.1f``)."""

    arg: Expr
    digits: int

    def cel(self, root: str = "self") -> str:
        return self.arg.cel(root)

    def eval(self, spec: Wire) -> Any:
        return self.arg.eval(spec)

    def verb(self) -> str:
        return f"%.{self.digits}f"

    def hole(self, spec: Wire) -> str:
        value = self.eval(spec)
        if not isinstance(value, float):
            raise CelError(f"%f of a {type(value).__name__}")
        return f"{value:.{self.digits}f}"


@dataclasses.dataclass(frozen=True, eq=False)
class Format(Expr):
    """A string built from a Text (``"...".format([...])``): a hole of another Text."""

    text: Text

    def cel(self, root: str = "self") -> str:
        return self.text.cel(root)

    def eval(self, spec: Wire) -> Any:
        return self.text.render(spec)

    def verb(self) -> str:
        return "%s"


def fmt(template: str, *args: Expr) -> Expr:
    return Format(Text(template, *args))


@dataclasses.dataclass(frozen=True, eq=False)
class Str(Expr):
    """A string-valued expression as a Text hole (``%s``)."""

    arg: Expr

    def cel(self, root: str = "self") -> str:
        return self.arg.cel(root)

    def eval(self, spec: Wire) -> Any:
        return _str(self.arg.eval(spec))

    def verb(self) -> str:
        return "%s"


@dataclasses.dataclass(frozen=True, eq=False)
class Var(Expr):
    """A named value: ``variables.<name>`` in the ValidatingAdmissionPolicy, which computes
    it once per request (``spec.variables``, in dependency order); evaluated in place here.
    A rule that reads one can't be in the CRD."""

    name: str
    expr: Expr

    def cel(self, root: str = "self") -> str:
        return f"variables.{self.name}"

    def eval(self, spec: Wire) -> Any:
        return self.expr.eval(spec)

    def verb(self) -> str:
        return self.expr.verb()

    def hole(self, spec: Wire) -> str:
        return self.expr.hole(spec)


@dataclasses.dataclass(frozen=True, eq=False)
class MapGet(Expr):
    """``key in m ? m[key] : default`` for a map of strings (a node selector)."""

    items: Expr
    key: str
    default: Expr

    def cel(self, root: str = "self") -> str:
        m, k = self.items.cel(root), json.dumps(self.key)
        return f"({k} in {m} ? {m}[{k}] : {self.default.cel(root)})"

    def eval(self, spec: Wire) -> Any:
        items = self.items.eval(spec)
        if not isinstance(items, Mapping):
            raise CelError(f"expected a map, got {items!r}")
        return items[self.key] if self.key in items else self.default.eval(spec)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


@dataclasses.dataclass(frozen=True, eq=False)
class ContainsFolded(Expr):
    """``s.lowerAscii().contains(part)``, ``part`` lower case (the strings library)."""

    text: Expr
    part: str

    def cel(self, root: str = "self") -> str:
        return f"{self.text.cel(root)}.lowerAscii().contains({json.dumps(self.part)})"

    def eval(self, spec: Wire) -> Any:
        return self.part in _str(self.text.eval(spec)).translate(_ASCII_LOWER)


def _children(node: object) -> list[Expr]:
    if isinstance(node, Text):
        return list(node.args)
    if not dataclasses.is_dataclass(node):
        return []
    out: list[Expr] = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if isinstance(value, Expr):
            out.append(value)
        elif isinstance(value, Text):
            out.extend(value.args)
    return out


def variables(*roots: object) -> list[Var]:
    """The Vars the expressions read, each after the Vars it reads (one per name)."""
    found: dict[str, Var] = {}

    def visit(node: object) -> None:
        for child in _children(node):
            visit(child)
        if isinstance(node, Var):
            other = found.setdefault(node.name, node)
            if other is not node:
                raise ValueError(f"two variables named {node.name}")

    for root in roots:
        visit(root)
    return list(found.values())


def _cel_string(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | str):
        return str(value)
    raise CelError(f"no %d/%s for {value!r}")


@dataclasses.dataclass(frozen=True)
class Text:
    """A sentence with ``{}`` holes filled by expressions: ``Text("{} heads", heads)``."""

    template: str
    args: tuple[Expr, ...] = ()

    def __init__(self, template: str, *args: Expr) -> None:
        if template.count("{}") != len(args):
            raise ValueError(f"{template!r} has {template.count('{}')} holes, {len(args)} args")
        object.__setattr__(self, "template", template)
        object.__setattr__(self, "args", tuple(args))

    def parts(self) -> list[str | Expr]:
        pieces = self.template.split("{}")
        out: list[str | Expr] = [pieces[0]]
        for arg, piece in zip(self.args, pieces[1:], strict=True):
            out += [arg, piece]
        return [p for p in out if p != ""]

    def render(self, spec: Wire) -> str:
        return "".join(p if isinstance(p, str) else p.hole(spec) for p in self.parts())

    def cel_format(self, root: str = "self") -> tuple[str, list[str]]:
        """The sentence as a CEL ``format`` string (each hole's verb: ``%d`` for an integer,
        ``%s`` for a string, ``%.1f`` for a double) and its arguments."""
        text = "".join(
            p.replace("%", "%%") if isinstance(p, str) else p.verb() for p in self.parts()
        )
        return text, [a.cel(root) for a in self.args]

    def cel(self, root: str = "self") -> str:
        """The sentence as a CEL string expression: ``"...".format([...])``."""
        text, args = self.cel_format(root)
        return f"{json.dumps(text)}.format([{', '.join(args)}])" if args else json.dumps(text)

    def static(self) -> str:
        """The sentence with each hole named by its CEL text (a fallback message)."""
        return "".join(p if isinstance(p, str) else p.cel("spec") for p in self.parts())
