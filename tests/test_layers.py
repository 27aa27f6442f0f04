"""The package's layers, read from the source: no module imports from a layer above its own,
and no module import cycle of any kind, imports only the type checker follows (`if
TYPE_CHECKING:`) included (docs/architecture.md, "Layers")."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]

# Bottom to top. A module may import from its own layer and the layers below.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("jaxrl4llm", "jaxrl4llm.config", "jaxrl4llm.parallel"),
    ("jaxrl4llm.rl", "jaxrl4llm.models"),
    ("jaxrl4llm.sampling",),
    ("jaxrl4llm.rewards", "jaxrl4llm.data", "jaxrl4llm.envs"),
    ("jaxrl4llm.eval",),
    # The trainer's rooms, bottom to top: its configuration, the run's infrastructure
    # (workdir, checkpoints, metrics, trackers), the update's math, the step's programs
    # (train/programs.py), the rollout, then the setup, the update stage and the loop
    # (train/*.py).
    ("jaxrl4llm.train.config",),
    ("jaxrl4llm.train.infra",),
    ("jaxrl4llm.train.update",),
    ("jaxrl4llm.train.programs",),
    ("jaxrl4llm.train.rollout",),
    ("jaxrl4llm.train",),
    ("jaxrl4llm.planner",),  # compiles the step's programs ahead of time
    ("jaxrl4llm.config.cli",),  # the flags and the entry points' error contract
    ("experiments", "tools"),
)
# Upward imports allowed by name; none is left.
KNOWN_UPWARD: set[tuple[str, str]] = set()
# No module cycles are left; a new one fails.
KNOWN_CYCLES: list[list[str]] = []


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for top in ("jaxrl4llm", "experiments", "tools"):
        for path in (REPO / top).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The project modules `path` imports: at module level, inside functions, and under `if
    TYPE_CHECKING:` (an import only the type checker follows still ties the two modules)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in modules}


def _layer(module: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def test_no_module_imports_from_a_higher_layer():
    upward = sorted(
        (m, t)
        for m, targets in _graph().items()
        for t in targets
        if _layer(t) > _layer(m) and (m, t) not in KNOWN_UPWARD
    )
    assert not upward, upward


def test_the_known_upward_imports_still_exist():
    """A stale exception would hide a new import of the same shape."""
    graph = _graph()
    assert all(t in graph[m] for m, t in KNOWN_UPWARD)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other (strongly connected components of more
    than one module), each sorted."""
    reach = {v: _reachable(graph, v) for v in graph}
    groups = {tuple(sorted(w for w in reach[v] if v in reach.get(w, ()))) for v in graph}
    return sorted(list(g) for g in groups if len(g) > 1)


def test_modules_import_each_other_without_new_cycles():
    # A package's __init__ re-exporting its own modules is not a cycle between modules.
    graph = {
        m: {t for t in targets if not m.startswith(t + ".") and (m, t) not in KNOWN_UPWARD}
        for m, targets in _graph().items()
    }
    assert sorted(_cycles(graph)) == KNOWN_CYCLES


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_type_checking_imports_count(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import jaxrl4llm.rl\n"
        "if TYPE_CHECKING:\n"
        "    from jaxrl4llm.train.config import TrainConfig\n"
    )
    modules = {"jaxrl4llm.rl": source, "jaxrl4llm.train.config": source}
    assert _imports(source, modules) == {"jaxrl4llm.rl", "jaxrl4llm.train.config"}
