"""No function in jaxrl4llm/ is longer than MAX_LINES lines, counted from its `def` line to
its last line as `ruff format` writes it (at most MAX_ALLOWED named exceptions, each with its
reason), and no module under jaxrl4llm/ or experiments/ is longer than MAX_MODULE_LINES lines
(docs/architecture.md, "Invariants"). The complexity limit is ruff's C901
(`[tool.ruff.lint.mccabe]` in pyproject.toml)."""

from __future__ import annotations

import ast
import pathlib
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 60

# {"path::qualified name": why it stays whole} of functions allowed over the limit; at most
# MAX_ALLOWED of them.
ALLOWED: dict[str, str] = {}
MAX_ALLOWED = 5

MAX_MODULE_LINES = 500
MODULE_TOPS = ("jaxrl4llm", "experiments")
# Modules allowed over MAX_MODULE_LINES, each with what it holds, each waiting to be split.
LONG_MODULES: dict[str, str] = {}


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


def _package_functions_over_the_limit() -> dict[str, int]:
    found: dict[str, int] = {}
    for module in sorted((REPO / "jaxrl4llm").rglob("*.py")):
        path = module.relative_to(REPO).as_posix()
        found.update(long_functions(module.read_text(encoding="utf-8"), path))
    return found


def test_no_package_function_is_over_the_line_limit():
    assert len(ALLOWED) <= MAX_ALLOWED and all(ALLOWED.values()), "at most 5, each with a reason"
    over = _package_functions_over_the_limit()
    new = sorted(f"{name} ({lines} lines)" for name, lines in over.items() if name not in ALLOWED)
    assert not new, (
        f"functions over {MAX_LINES} lines in jaxrl4llm/ (split each into named "
        f"helpers): {', '.join(new)}"
    )
    stale = sorted(set(ALLOWED) - set(over))
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


def long_modules(
    root: pathlib.Path, tops: tuple[str, ...], max_lines: int = MAX_MODULE_LINES
) -> dict[str, int]:
    """Every .py file under root/top (for each of `tops`) longer than `max_lines` lines, as
    {"top/path.py": lines}."""
    found: dict[str, int] = {}
    for top in tops:
        for module in sorted((root / top).rglob("*.py")):
            lines = len(module.read_text(encoding="utf-8").splitlines())
            if lines > max_lines:
                found[module.relative_to(root).as_posix()] = lines
    return found


def test_no_module_is_over_the_line_limit():
    over = long_modules(REPO, MODULE_TOPS)
    new = sorted(
        f"{path} ({lines} lines)" for path, lines in over.items() if path not in LONG_MODULES
    )
    assert not new, (
        f"modules over {MAX_MODULE_LINES} lines (split each along its concerns, "
        f"docs/architecture.md): {', '.join(new)}"
    )
    stale = sorted(set(LONG_MODULES) - set(over))
    assert not stale, (
        f"within {MAX_MODULE_LINES} lines now (or gone): remove from LONG_MODULES: "
        f"{', '.join(stale)}"
    )


def test_the_module_checker_counts_lines_under_each_top(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "pkg" / "at_limit.py").write_text("x = 1\n" * 500)
    (tmp_path / "pkg" / "sub" / "over.py").write_text("x = 1\n" * 501)
    (tmp_path / "pkg" / "notes.txt").write_text("x\n" * 900)
    (tmp_path / "other" / "big.py").write_text("x = 1\n" * 900)
    assert long_modules(tmp_path, ("pkg",)) == {"pkg/sub/over.py": 501}
    assert long_modules(tmp_path, ("pkg", "other"), max_lines=600) == {"other/big.py": 900}
