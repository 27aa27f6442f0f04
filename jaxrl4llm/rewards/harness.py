"""Assert-style tests decided outside the program: the sandbox computes values, we compare.

A test case such as `assert add(1, 2) == 3` is split here, on the trusted side, into holes
(the sub-expressions that need the program: `add(1, 2)`) and a check over them (`#0 == 3`).
The sandboxed run gets the program, the test's setup (less its test functions and asserts)
and rewards/_harness_child.py, which evaluates the holes and prints their values in a tagged
JSON form. `decide` decodes those into plain values (int, float, str, list, tuple, dict, set,
... never an object of the program's classes) and evaluates the check with the real builtins.
So no expected value ever enters the sandbox, and nothing the program does there (exiting
early, exit hooks, patched builtins or test modules, an object whose `__eq__` is always true,
reading its own code object, printing early) can do more than choose the values its holes
return, which is what a program is for.

The trusted side evaluates literals, containers, arithmetic, comparisons, `and`/`or`/`not`,
subscripts and calls to a fixed set of pure builtins (TRUSTED) and `math` functions (MATH);
any other sub-expression (a call to the program, a name the test's setup defines) is a hole.
A case may also call a test function `check(candidate)` (HumanEval), defined in the setup or
the case, whose body is asserts: each assert is one check, `candidate` replaced by the
argument. What cannot be split this way is refused, never run the old way (see `plan_case`).
"""

from __future__ import annotations

import ast
import math
import os
from typing import Any, NamedTuple

MARK = "\n\x1ejaxrl4llm-values\x1e"  # the child's report line starts after this
HOLE = "#"  # a hole's name in a check: "#0", "#1", ... (no test can name one)
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_harness_child.py")
TRUSTED: dict[str, Any] = {
    f.__name__: f
    for f in (abs, all, any, bool, bytes, chr, complex, dict, divmod, enumerate, float)
    + (frozenset, hex, int, isinstance, len, list, max, min, ord, range, repr, reversed)
    + (round, set, sorted, str, sum, tuple, type, zip)
}
MATH = {
    name: getattr(math, name)
    for name in (
        "isclose fabs isnan isinf isfinite sqrt floor ceil trunc fsum prod gcd log log2 log10"
        " exp pi e inf nan tau"
    ).split()
}
TEST_BODY = (ast.Assert, ast.Pass, ast.Import, ast.ImportFrom)


class Check(NamedTuple):
    test: ast.expr  # the assert's test, each hole replaced by a Name "#i"
    source: str  # the assert as written, for the verdict's detail


class CasePlan(NamedTuple):
    checks: tuple[Check, ...]
    holes: tuple[str, ...]  # expressions the sandbox evaluates, in this order
    setup: str  # the setup the sandbox runs after the program (no test function, no assert)
    problem: str  # why the case cannot be decided here ("" when it can); it then fails
    trusted: dict[str, Any] = {}  # the checks' names that are not holes: builtins, math


def bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (inside if / for / try / with blocks too, not
    inside functions or classes): definitions, assignments, imports."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(child.name)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                found.update((a.asname or a.name).split(".")[0] for a in child.names)
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                found.add(child.id)
            elif not isinstance(child, (ast.Lambda, ast.expr_context)):
                visit(child)

    visit(tree)
    return found


def program_names(code: str) -> frozenset[str]:
    """The top-level names a program binds (empty when it does not parse: it then fails)."""
    try:
        return frozenset(bound_names(ast.parse(code)))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return frozenset()


class _Scope(NamedTuple):
    trusted: dict[str, Any]  # name -> the trusted value it stands for in a check
    setup_names: frozenset[str]  # names the setup binds (their calls are reference values)
    program: frozenset[str]


def _scope(setup_tree: ast.Module, program: frozenset[str]) -> _Scope:
    trusted: dict[str, Any] = dict(TRUSTED)
    for statement in setup_tree.body:  # `import math` / `from math import isclose` stay ours
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                if alias.name == "math":
                    trusted[alias.asname or "math"] = math
        elif isinstance(statement, ast.ImportFrom) and statement.module == "math":
            for alias in statement.names:
                if alias.name in MATH:
                    trusted[alias.asname or alias.name] = MATH[alias.name]
    trusted.setdefault("math", math)
    setup_names = frozenset(bound_names(setup_tree)) - set(trusted)
    for name in set(trusted) & (setup_names | program):
        del trusted[name]
    return _Scope(trusted, setup_names, program)


def _is_trusted_reference(node: ast.expr, scope: _Scope) -> bool:
    if isinstance(node, ast.Name):
        return node.id in scope.trusted
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return scope.trusted.get(node.value.id) is math and node.attr in MATH
    return False


_CONTAINERS = (ast.Tuple, ast.List, ast.Set, ast.Dict)
_COMPOSITE = (ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Subscript, ast.Slice)


def _trusted_shape(node: ast.AST, scope: _Scope) -> bool:
    """Whether `node` itself is evaluated here (its children are classified in turn)."""
    if isinstance(node, (ast.Constant, *_CONTAINERS, *_COMPOSITE)):
        return not any(isinstance(c, ast.Starred) for c in ast.iter_child_nodes(node)) and not (
            isinstance(node, ast.Dict) and None in node.keys
        )
    if isinstance(node, (ast.Name, ast.Attribute)):
        return _is_trusted_reference(node, scope)
    if isinstance(node, ast.Call):
        return (
            _is_trusted_reference(node.func, scope)
            and not any(isinstance(a, ast.Starred) for a in node.args)
            and all(k.arg is not None for k in node.keywords)
        )
    return isinstance(
        node, (ast.operator, ast.boolop, ast.cmpop, ast.unaryop, ast.keyword, ast.expr_context)
    )


class _Splitter(ast.NodeTransformer):
    """Replaces each maximal sub-expression that needs the program by a hole."""

    def __init__(self, scope: _Scope):
        self.scope = scope
        self.holes: list[str] = []
        self.roots: list[str] = []  # the name each hole starts from (its callee, mostly)

    def visit(self, node: ast.AST) -> Any:
        if _trusted_shape(node, self.scope):
            if isinstance(node, ast.Call):  # the function stays ours, its arguments are split
                node.args = [self.visit(a) for a in node.args]
                node.keywords = [self.visit(k) for k in node.keywords]
                return node
            return self.generic_visit(node)
        if not isinstance(node, ast.expr):
            raise ValueError(f"unsupported syntax {type(node).__name__}")
        self.holes.append(ast.unparse(node))
        self.roots.append(_root_name(node))
        return ast.copy_location(ast.Name(id=f"{HOLE}{len(self.holes) - 1}", ctx=ast.Load()), node)


def _root_name(node: ast.expr) -> str:
    while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def _compares_with_a_trusted_value(test: ast.expr) -> bool:
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test = test.operand
    if not isinstance(test, ast.Compare):
        return False
    operands = [test.left, *test.comparators]
    return any(
        not any(isinstance(n, ast.Name) and n.id.startswith(HOLE) for n in ast.walk(operand))
        for operand in operands
    )


def _test_functions(trees: list[ast.Module]) -> dict[str, ast.FunctionDef]:
    """Top-level functions of one positional parameter whose body is asserts (and imports,
    `pass`, a docstring): HumanEval's check(candidate)."""
    found = {}
    for tree in trees:
        for node in tree.body:
            if (
                isinstance(node, ast.FunctionDef)
                and len(node.args.args) == 1
                and not (node.args.vararg or node.args.kwarg or node.args.kwonlyargs)
                and any(isinstance(s, ast.Assert) for s in node.body)
                and all(isinstance(s, TEST_BODY) or _is_docstring(s) for s in node.body)
            ):
                found[node.name] = node
    return found


def _is_docstring(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)


class _Rename(ast.NodeTransformer):
    def __init__(self, name: str, value: ast.expr):
        self.name, self.value = name, value

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return self.value if node.id == self.name else node


def _asserts_of(statement: ast.stmt, functions: dict[str, ast.FunctionDef]) -> list[ast.Assert]:
    """The asserts a case statement stands for; ValueError when it is not a test."""
    if isinstance(statement, ast.Assert):
        return [statement]
    if isinstance(statement, (ast.Pass, ast.Import, ast.ImportFrom)) or _is_docstring(statement):
        return []
    if isinstance(statement, ast.FunctionDef) and statement.name in functions:
        return []
    call = statement.value if isinstance(statement, ast.Expr) else None
    if (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id in functions
        and len(call.args) == 1
        and not call.keywords
    ):
        function = functions[call.func.id]
        rename = _Rename(function.args.args[0].arg, call.args[0])
        return [rename.visit(s) for s in function.body if isinstance(s, ast.Assert)]
    raise ValueError(f"unsupported test statement: {ast.unparse(statement)[:80]}")


def _imports(statements: list[ast.stmt], functions: dict[str, ast.FunctionDef]) -> list[str]:
    """Imports of the case and of its test functions: the holes may need them."""
    found = [s for s in statements if isinstance(s, (ast.Import, ast.ImportFrom))]
    found += [s for f in functions.values() for s in f.body if isinstance(s, ast.Import)]
    found += [s for f in functions.values() for s in f.body if isinstance(s, ast.ImportFrom)]
    return [ast.unparse(s) for s in found]


def _child_setup(setup_tree: ast.Module, functions: dict[str, ast.FunctionDef]) -> str:
    kept = [
        s
        for s in setup_tree.body
        if not isinstance(s, ast.Assert)
        and not (isinstance(s, ast.FunctionDef) and s.name in functions)
    ]
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


def _check_of(statement: ast.Assert, splitter: _Splitter, program: frozenset[str]) -> Check:
    source = ast.unparse(statement.test)
    used = {n.id for n in ast.walk(statement.test) if isinstance(n, ast.Name)}
    redefined = sorted(used & program & (set(TRUSTED) | {"math"}))
    if redefined:
        raise ValueError(f"the program redefines {', '.join(redefined)}, which the test uses")
    first = len(splitter.holes)
    test = splitter.visit(statement.test)
    references = [
        root for root in splitter.roots[first:] if root in splitter.scope.setup_names - program
    ]
    if references and not _compares_with_a_trusted_value(test):
        raise ValueError(
            f"`{source[:80]}` compares values the sandbox computes with the test's own "
            f"{references[0]}"
        )
    return Check(ast.fix_missing_locations(ast.Expression(test)).body, source)


def plan_case(case: str, setup: str, program: frozenset[str]) -> CasePlan:
    """The checks and holes of one assert-style case. A case that cannot be split into checks
    decided here (a statement other than asserts and test-function calls, a check that only
    compares values computed in the sandbox by the setup's code, or a test that uses a builtin
    the program redefines) gets a `problem`: it fails, whatever the program does."""
    try:
        setup_tree, case_tree = ast.parse(setup or ""), ast.parse(case)
    except (SyntaxError, ValueError, RecursionError) as exc:
        return CasePlan((), (), "", f"the test does not parse: {exc}")
    functions = _test_functions([setup_tree, case_tree])
    splitter = _Splitter(_scope(setup_tree, program))
    try:
        statements = [a for s in case_tree.body for a in _asserts_of(s, functions)]
        checks = tuple(_check_of(s, splitter, program) for s in statements)
    except (ValueError, RecursionError) as exc:
        return CasePlan((), (), "", str(exc))
    child_setup = "\n".join(
        [_child_setup(setup_tree, functions), *_imports(case_tree.body, functions)]
    )
    return CasePlan(checks, tuple(splitter.holes), child_setup, "", splitter.scope.trusted)


def child_source(code: str, plan: CasePlan) -> str:
    """What the sandbox runs for one case: the program, the setup, then the harness."""
    with open(_CHILD, encoding="utf-8") as f:
        harness = f.read()
    return (
        f"{code}\n\n{plan.setup}\n\n{harness}\n"
        f"_jaxrl4llm_harness({list(plan.holes)!r}, {MARK!r}, globals())\n"
    )
