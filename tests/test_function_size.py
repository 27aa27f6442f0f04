"""No function in jaxrl4llm/train/ is longer than MAX_LINES lines, counted from its `def` line
to its last line as `ruff format` writes it (docs/architecture.md, "Invariants"). The
complexity limit is ruff's C901 (`[tool.ruff.lint.mccabe]` in pyproject.toml)."""

from __future__ import annotations

import ast
import pathlib
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 60

# "path::qualified name" of functions allowed over the limit, each waiting to be split.
ALLOWED: set[str] = set()


def long_functions(source: str, path: str, max_lines: int = MAX_LINES) -> dict[str, int]:
    """Every function or method of `source` longer than `max_lines` lines (def line to last
    line, decorators not counted), as {"path::Class.name": lines}; nested functions count on
    their own, named after their enclosing function."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    lines = child.end_lineno - child.lineno + 1
                    if lines > max_lines:
                        found[f"{path}::{name}"] = lines
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _train_functions_over_the_limit() -> dict[str, int]:
    found: dict[str, int] = {}
    for module in sorted((REPO / "jaxrl4llm" / "train").rglob("*.py")):
        path = module.relative_to(REPO).as_posix()
        found.update(long_functions(module.read_text(encoding="utf-8"), path))
    return found


def test_no_train_function_is_over_the_line_limit():
    over = _train_functions_over_the_limit()
    new = sorted(f"{name} ({lines} lines)" for name, lines in over.items() if name not in ALLOWED)
    assert not new, (
        f"functions over {MAX_LINES} lines in jaxrl4llm/train/ (split each into named "
        f"helpers): {', '.join(new)}"
    )
    stale = sorted(ALLOWED - set(over))
    assert not stale, f"within {MAX_LINES} lines now: remove from ALLOWED: {', '.join(stale)}"


def _function(name: str, body_lines: int, indent: str = "") -> str:
    """A function of exactly 1 + body_lines lines."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}():\n{body}"


def test_the_checker_counts_def_line_to_last_line():
    source = _function("at_limit", 59) + "\n\n" + _function("over_limit", 60)
    assert long_functions(source, "m.py") == {"m.py::over_limit": 61}


def test_the_checker_finds_methods_and_nested_functions_and_skips_decorators():
    source = (
        "class Box:\n"
        + "    @staticmethod\n" * 5
        + _function("method", 58, indent="    ")
        + "\n"
        + _function("outer", 62)
        + textwrap.indent(_function("inner", 61), "    ")
        + "    return 1\n"
    )
    assert long_functions(source, "pkg/m.py") == {
        "pkg/m.py::outer": 63 + 62 + 1,
        "pkg/m.py::outer.inner": 62,
    }
