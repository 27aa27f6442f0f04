"""Code answers: the last fenced Python block of a completion, run against tests in the sandbox.

A code record carries its tests in metadata["tests"] (a JSON string), in one of two styles:

    {"style": "stdio", "cases": [{"input": "1 2\\n", "output": "3\\n"}, ...]}
    {"style": "assert", "setup": "import math", "cases": ["assert add(1, 2) == 3", ...]}

stdio: the program reads a case's input on stdin; it passes when its whole stdout matches the
expected output (outputs_match: trailing whitespace and blank lines ignored, tokens equal,
non-integer numbers within 1e-6), compared here. assert: the verdict is never the program's.
rewards/harness.py splits each case into the expressions that need the program (its calls)
and checks over their values; the sandbox runs the program, the setup and those expressions
and sends their values back as data; rewards/verdict.py decodes them into plain values and
evaluates the checks with the real builtins. No expected value enters the sandbox, so
exiting early, exit hooks, patched builtins or an object whose __eq__ is always true pass
nothing. A case that cannot be split that way fails (the detail says why).

Each case is one sandboxed execution (rewards/sandbox.py) inside one pool job per completion,
so a hung or crashing program costs its own worker's item deadline only. Reward: "all_pass"
(1 when every case passes; stops at the first failure) or "fraction" (the share passed, as the
verdict's score). The job's budget is a fraction of the pool's item deadline; cases it leaves
unrun count as failed. The verdict's detail names the first failing case.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
from typing import Any

from jaxrl4llm.rewards import harness
from jaxrl4llm.rewards.base import Job, PlansPerCompletion, Verdict, record_metadata
from jaxrl4llm.rewards.sandbox import Execution, SandboxConfig, resolve_isolation, run_program
from jaxrl4llm.rewards.verdict import decide, read_values

MODES = ("all_pass", "fraction")
STYLES = ("stdio", "assert")
BUDGET_FRACTION = 0.9  # of the pool's item deadline; the rest is IPC and the worker's start
TEST_COST_S = 0.5  # a test's allowance in the batch deadline (~0.08 s measured, 2 loaded cores)
_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+-]*)[^\n`]*$", re.MULTILINE)
_PYTHON_TAGS = ("", "python", "python3", "py", "py3")
_INT_RE = re.compile(r"[+-]?\d+")
TOLERANCE = 1e-6
MAX_DETAIL = 300


@dataclasses.dataclass(frozen=True)
class CodeConfig:
    mode: str = "all_pass"
    max_code_chars: int = 20_000  # longer extracted programs are a parse_error, never run
    budget_s: float = 4.5  # all cases of one completion (< the pool's item deadline)
    sandbox: SandboxConfig = SandboxConfig()

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown code reward mode {self.mode!r}; valid: {', '.join(MODES)}")


def extract_code(completion: str) -> str | None:
    """The last complete fenced block tagged python (or untagged), else None. Linear time:
    one regex pass over fence lines; an unclosed last fence (a truncated completion) is
    skipped for the previous complete block."""
    found, opening = None, None
    for fence in _FENCE_RE.finditer(completion):
        if opening is None:
            opening = fence
        else:
            if opening.group(1).lower() in _PYTHON_TAGS:
                found = (opening.end() + 1, fence.start())
            opening = None
    if found is None:
        return None
    return completion[found[0] : found[1]]


def _tokens_match(actual: str, expected: str) -> bool:
    if actual == expected:
        return True
    if _INT_RE.fullmatch(actual) and _INT_RE.fullmatch(expected):
        return int(actual) == int(expected)
    try:
        a, e = float(actual), float(expected)
    except ValueError:
        return False
    return abs(a - e) <= TOLERANCE * max(1.0, abs(e))


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def outputs_match(actual: str, expected: str) -> bool:
    """Judge's comparison: line by line, whitespace-separated tokens; trailing spaces and
    blank lines at the end ignored; integers exact, other numbers within 1e-6 (relative above
    1); anything else byte-equal."""
    got, want = _lines(actual), _lines(expected)
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        g_tokens, w_tokens = g.split(), w.split()
        if len(g_tokens) != len(w_tokens):
            return False
        if not all(_tokens_match(a, e) for a, e in zip(g_tokens, w_tokens)):
            return False
    return True


def parse_tests(tests_json: str) -> dict:
    """A record's tests, checked; raises ValueError naming what is wrong (a data error)."""
    tests = json.loads(tests_json)
    if not isinstance(tests, dict) or tests.get("style") not in STYLES:
        raise ValueError(f"code tests need a style in {STYLES}, got {str(tests)[:100]!r}")
    cases = tests.get("cases")
    if not isinstance(cases, list) or not cases:
        raise ValueError("code tests need a non-empty list of cases")
    if tests["style"] == "stdio" and not all(
        isinstance(c, dict) and isinstance(c.get("input"), str) and isinstance(c.get("output"), str)
        for c in cases
    ):
        raise ValueError("stdio code tests: every case needs an input and an output string")
    if tests["style"] == "assert" and not all(isinstance(c, str) for c in cases):
        raise ValueError("assert code tests: every case is a string of Python")
    return tests


@functools.lru_cache(maxsize=256)
def case_count(tests_json: str) -> int:
    """How many cases a record's tests have (0 when they do not parse: the job reports it).
    Cached: a group's completions share their record's tests."""
    try:
        cases = json.loads(tests_json).get("cases")
    except (ValueError, AttributeError):
        return 0
    return len(cases) if isinstance(cases, list) else 0


def _describe(execution: Execution, tail: str) -> str:
    if execution.status == "timeout":
        return "time limit exceeded"
    if execution.status == "signal":
        assert execution.returncode is not None  # the signal's number, negated
        return f"killed by signal {-execution.returncode}"
    if execution.status == "exit":
        lines = execution.stderr.strip().splitlines()
        return f"exit code {execution.returncode}" + (f": {lines[-1]}" if lines else "")
    return tail


def run_case(
    code: str,
    tests: dict,
    index: int,
    sandbox: SandboxConfig,
    layer: str,
    names: frozenset[str] = frozenset(),
) -> tuple[bool, str, str]:
    """(passed, why it failed, status) of case `index`; `names`: the program's top-level
    names (harness.program_names), for assert-style cases."""
    case = tests["cases"][index]
    if tests["style"] == "stdio":
        execution = run_program(code, case["input"], sandbox, layer)
        if execution.status != "ok":
            return False, _describe(execution, ""), execution.status
        if outputs_match(execution.stdout, case["output"]):
            return True, "", execution.status
        return (
            False,
            (f"expected {case['output'][:80]!r}, got {execution.stdout[:80]!r}"),
            execution.status,
        )
    plan = harness.plan_case(case, tests.get("setup") or "", names)
    if plan.problem:
        return False, f"cannot be decided outside the program: {plan.problem}", "ok"
    execution = run_program(harness.child_source(code, plan), "", sandbox, layer)
    if execution.status != "ok":
        return False, _describe(execution, ""), execution.status
    values = read_values(execution.stdout, len(plan.holes))
    if values is None:
        return False, "exited before the test finished", execution.status
    passed, why = decide(plan, values)
    return passed, why, execution.status


def run_code_tests(
    code: str, tests_json: str, mode: str, sandbox: SandboxConfig, layer: str, budget_s: float
) -> tuple[str, float, str]:
    """Runs in a pool worker: (reason, score, first failing case) for a program's tests.
    "error" when the sandbox itself could not be set up (the row is masked, not wrong)."""
    tests = parse_tests(tests_json)
    deadline = time.monotonic() + budget_s
    cases = tests["cases"]
    names = harness.program_names(code) if tests["style"] == "assert" else frozenset()
    passed, failure = 0, ""
    for index in range(len(cases)):
        if time.monotonic() + sandbox.wall_s > deadline:
            failure = failure or (
                f"test {index}: not run, the {budget_s:g} s budget was "
                "spent (raise --item_timeout_s)"
            )
            break
        ok, why, status = run_case(code, tests, index, sandbox, layer, names)
        if status == "setup_failed":
            return "error", 0.0, f"sandbox set-up failed: {why}"[:MAX_DETAIL]
        if ok:
            passed += 1
            continue
        failure = failure or f"test {index}: {why}"[:MAX_DETAIL]
        if mode == "all_pass":
            break
    reason = "correct" if passed == len(cases) else "wrong"
    score = passed / len(cases) if mode == "fraction" else float(reason == "correct")
    return reason, score, failure


class CodeVerifier(PlansPerCompletion):
    """Runs each completion's last Python block against its record's tests, sandboxed."""

    def __init__(self, config: CodeConfig = CodeConfig()):
        self.config = config
        self._layer: str | None = None

    @property
    def layer(self) -> str:
        """The isolation layer, resolved at the first code record (DependencyError if none)."""
        if self._layer is None:
            self._layer = resolve_isolation(self.config.sandbox)
        return self._layer

    def plan_one(self, completion: str, record: Any) -> Verdict | Job:
        tests_json = record_metadata(record).get("tests")
        if not isinstance(tests_json, str):
            raise ValueError(
                "a code record needs metadata['tests'], a JSON string of "
                "{'style': 'stdio' | 'assert', 'cases': [...]}"
            )
        code = extract_code(completion)
        if code is None or not code.strip():
            return Verdict(False, "no_answer", 0.0, "no fenced python code block")
        if len(code) > self.config.max_code_chars:
            return Verdict(
                False,
                "parse_error",
                0.0,
                f"code longer than {self.config.max_code_chars} characters",
            )
        return Job(
            run_code_tests,
            (
                code,
                tests_json,
                self.config.mode,
                self.config.sandbox,
                self.layer,
                self.config.budget_s,
            ),
            TEST_COST_S * case_count(tests_json),
        )

    def answer_key(self, completion: str, record: Any) -> str | None:
        """The program maj@k votes on, whitespace-collapsed."""
        code = extract_code(completion)
        return " ".join(code.split()) or None if code else None
