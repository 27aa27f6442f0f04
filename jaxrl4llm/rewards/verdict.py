"""The trusted side's verdict on an assert-style case: decode the values the sandbox sent
(rewards/_harness_child.py) and evaluate each check (rewards/harness.py) over them.

Decoding makes plain values only: None, bool, int, float, complex, str, bytes, list, tuple,
dict, set, frozenset, range, fractions.Fraction, decimal.Decimal, and a list iterator for an
iterator the program returned. A check is evaluated by walking its syntax tree with the real
builtins (harness.TRUSTED, harness.MATH): no code of the program or of the test runs here.
"""

from __future__ import annotations

import ast
import decimal
import fractions
import json
import operator
from typing import Any, Callable, NamedTuple

from jaxrl4llm.rewards.harness import HOLE, MARK, MATH, CasePlan

MAX_EXPONENT = 10_000  # an int `**` past it fails the check (the value would be huge)
MAX_ITEMS = 10_000_000  # a sequence repeated (`*`) or shifted past it fails the check
MAX_DETAIL = 120


class Raised(NamedTuple):
    """A hole whose evaluation raised in the sandbox: a check that uses it fails."""

    why: str


class HoleRaised(Exception):
    pass


_SEQUENCES = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
_SCALARS: dict[str, Callable[..., Any]] = {
    "int": lambda h: int(h, 16),
    "float": float.fromhex,
    "complex": lambda r, i: complex(float.fromhex(r), float.fromhex(i)),
    "bytes": bytes.fromhex,
    "range": lambda *h: range(*(int(x, 16) for x in h)),
    "fraction": lambda n, d: fractions.Fraction(int(n, 16), int(d, 16)),
    "decimal": decimal.Decimal,
}


def decode(value: Any) -> Any:
    """A value as the harness encoded it; ValueError, KeyError or TypeError when malformed."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if not (isinstance(value, list) and value and isinstance(value[0], str)):
        raise ValueError(f"malformed value {str(value)[:40]!r}")
    tag, *rest = value
    if tag in _SEQUENCES or tag == "iter":
        (items,) = rest
        made = [decode(item) for item in items]
        return iter(made) if tag == "iter" else _SEQUENCES[tag](made)
    if tag == "dict":
        (pairs,) = rest
        return {decode(k): decode(v) for k, v in pairs}
    if not all(isinstance(r, str) for r in rest):
        raise ValueError(f"malformed {tag}")
    return _SCALARS[tag](*rest)


def read_values(stdout: str, count: int) -> list[Any] | None:
    """The `count` hole values (a Raised for a hole that raised) of the last report line in
    `stdout`; None when there is none or it is malformed."""
    start = stdout.rfind(MARK)
    if start < 0:
        return None
    line = stdout[start + len(MARK) :].split("\n", 1)[0]
    try:
        found = json.loads(line)
        if not isinstance(found, list) or len(found) != count:
            return None
        values = []
        for kind, value in found:
            if kind not in ("ok", "raised"):
                return None
            values.append(decode(value) if kind == "ok" else Raised(str(value)))
        return values
    except (ValueError, TypeError, KeyError, RecursionError, ArithmeticError, MemoryError):
        return None


_BINARY_NAMES = (
    "Add add Sub sub Mult mul Div truediv FloorDiv floordiv Mod mod Pow pow BitAnd and_ BitOr "
    "or_ BitXor xor LShift lshift RShift rshift"
)
_UNARY: dict[type, Callable[[Any], Any]] = {ast.Not: operator.not_, ast.USub: operator.neg}
_UNARY.update({ast.UAdd: operator.pos, ast.Invert: operator.invert})
_BINARY = {  # ast node -> operator function, in pairs
    getattr(ast, node): getattr(operator, function)
    for node, function in zip(*[iter(_BINARY_NAMES.split())] * 2)
}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}


def _too_big(op: ast.operator, a: Any, b: Any) -> bool:
    """Whether `a op b` would build a huge value (the check then fails instead)."""
    if isinstance(op, ast.Pow):
        return isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b > MAX_EXPONENT
    if isinstance(op, ast.LShift):
        return isinstance(b, int) and b > MAX_ITEMS
    if isinstance(op, ast.Mult):
        for n, s in ((a, b), (b, a)):
            if isinstance(n, int) and isinstance(s, (str, bytes, list, tuple)):
                return n * max(1, len(s)) > MAX_ITEMS
    return False


def _binary(node: ast.BinOp, env: dict[str, Any]) -> Any:
    a, b = evaluate(node.left, env), evaluate(node.right, env)
    if _too_big(node.op, a, b):
        raise ValueError("the value would be too large")
    return _BINARY[type(node.op)](a, b)


def _compare(node: ast.Compare, env: dict[str, Any]) -> Any:
    left = evaluate(node.left, env)
    for op, right_node in zip(node.ops, node.comparators):
        right = evaluate(right_node, env)
        if not _COMPARE[type(op)](left, right):
            return False
        left = right
    return True


def _boolean(node: ast.BoolOp, env: dict[str, Any]) -> Any:
    value: Any = None
    for item in node.values:
        value = evaluate(item, env)
        if bool(value) != isinstance(node.op, ast.And):
            return value
    return value


def _name(node: ast.Name, env: dict[str, Any]) -> Any:
    value = env[node.id]
    if isinstance(value, Raised):
        raise HoleRaised(value.why)
    return value


def _call(node: ast.Call, env: dict[str, Any]) -> Any:
    function = evaluate(node.func, env)
    args = [evaluate(a, env) for a in node.args]
    return function(*args, **{k.arg: evaluate(k.value, env) for k in node.keywords if k.arg})


def _slice(node: ast.Slice, env: dict[str, Any]) -> slice:
    parts = (node.lower, node.upper, node.step)
    return slice(*(None if p is None else evaluate(p, env) for p in parts))


_EVALUATORS: dict[type, Callable[[Any, dict[str, Any]], Any]] = {
    ast.Constant: lambda n, env: n.value,
    ast.Name: _name,
    ast.Attribute: lambda n, env: MATH[n.attr],
    ast.Tuple: lambda n, env: tuple(evaluate(e, env) for e in n.elts),
    ast.List: lambda n, env: [evaluate(e, env) for e in n.elts],
    ast.Set: lambda n, env: {evaluate(e, env) for e in n.elts},
    ast.Dict: lambda n, env: {evaluate(k, env): evaluate(v, env) for k, v in zip(n.keys, n.values)},
    ast.UnaryOp: lambda n, env: _UNARY[type(n.op)](evaluate(n.operand, env)),
    ast.BinOp: _binary,
    ast.BoolOp: _boolean,
    ast.Compare: _compare,
    ast.IfExp: lambda n, env: evaluate(n.body if evaluate(n.test, env) else n.orelse, env),
    ast.Subscript: lambda n, env: evaluate(n.value, env)[evaluate(n.slice, env)],
    ast.Slice: _slice,
    ast.Call: _call,
}


def evaluate(node: ast.expr, env: dict[str, Any]) -> Any:
    """The value of a check's expression; `env` maps hole names and trusted names."""
    return _EVALUATORS[type(node)](node, env)


def decide(plan: CasePlan, values: list[Any]) -> tuple[bool, str]:
    """(passed, why not) of a case whose holes have `values`."""
    env = dict(plan.trusted)
    env.update((f"{HOLE}{i}", value) for i, value in enumerate(values))
    for check in plan.checks:
        try:
            held = bool(evaluate(check.test, env))
        except HoleRaised as exc:
            return False, f"`{check.source[:MAX_DETAIL]}` raised {exc}"
        except (Exception, RecursionError) as exc:  # noqa: BLE001 - the check failed
            return False, f"`{check.source[:MAX_DETAIL]}` failed: {type(exc).__name__}"
        if not held:
            return False, f"`{check.source[:MAX_DETAIL]}` is false"
    return True, ""
