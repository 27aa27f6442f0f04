"""Public code datasets' rows -> code records' fields: the question, the tests, a reference.

Each form takes one row as the Hub stores it and returns the row the benchmark registry
(data/benchmarks.py) reads, with "question" (the prompt), "tests" (the JSON the code verifier
runs, rewards/code.py) and "code_answer" (a reference solution when the set has one, else the
tests), or None for a row the verifier cannot run (counted and dropped):

- APPS (codeparrot/apps): `input_output` is a JSON string {"inputs": [...], "outputs": [...]},
  stdin/stdout cases; rows with "fn_name" (call-based problems) are dropped.
- MBPP (google-research-datasets/mbpp, "full" or "sanitized"): `test_list` assert lines, with
  `test_setup_code` (full) or `test_imports` (sanitized) as setup; the question shows the
  tests, as the MBPP paper's prompt does, so the function's name and signature are known.
- HumanEval (openai/openai_humaneval): `test` defines check(candidate); one assert-style case
  calls check(entry_point). The question is the signature and docstring to complete.

At most MAX_CASES cases per problem: the verifier runs a completion's cases within one pool
job's budget, and cases it cannot reach count as failed.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

MAX_CASES = 10
CODE_INSTRUCTION = (
    "Write a complete Python 3 program in one ```python fenced block: it reads "
    "the input from standard input and prints the answer to standard output."
)
FUNCTION_INSTRUCTION = (
    "Write the complete Python 3 function in one ```python fenced block "
    "(imports included); do not print or read anything."
)


def _as_text(value: Any) -> str:
    """An APPS input or output: a string, or a list of lines."""
    if isinstance(value, (list, tuple)):
        return "\n".join(str(v) for v in value) + "\n"
    return str(value)


def _first_solution(value: Any) -> str | None:
    """APPS `solutions`: a JSON string of a list of programs."""
    try:
        solutions = json.loads(value) if isinstance(value, str) and value else value
    except json.JSONDecodeError:
        return None
    if isinstance(solutions, list) and solutions and isinstance(solutions[0], str):
        return solutions[0]
    return None


def apps_row(row: Mapping[str, Any]) -> dict[str, Any] | None:
    try:
        io = json.loads(row.get("input_output") or "")
    except json.JSONDecodeError:
        return None
    if not isinstance(io, dict) or io.get("fn_name"):
        return None
    inputs, outputs = io.get("inputs"), io.get("outputs")
    if (
        not isinstance(inputs, list)
        or not isinstance(outputs, list)
        or not inputs
        or len(inputs) != len(outputs)
    ):
        return None
    cases = [
        {"input": _as_text(i), "output": _as_text(o)}
        for i, o in zip(inputs[:MAX_CASES], outputs[:MAX_CASES])
    ]
    tests = json.dumps({"style": "stdio", "cases": cases})
    return {
        "question": str(row.get("question") or "").strip(),
        "tests": tests,
        "code_answer": _first_solution(row.get("solutions")) or tests,
        "instruction": CODE_INSTRUCTION,
        "problem_id": row.get("problem_id"),
        "difficulty": row.get("difficulty"),
    }


def mbpp_row(row: Mapping[str, Any]) -> dict[str, Any] | None:
    asserts = [str(t) for t in (row.get("test_list") or []) if str(t).strip()]
    if not asserts:
        return None
    setup = row.get("test_setup_code")
    if setup is None:
        setup = "\n".join(str(line) for line in row.get("test_imports") or [])
    text = str(row.get("text") or row.get("prompt") or "").strip()
    question = text + "\nYour code should pass these tests:\n" + "\n".join(asserts)
    tests = json.dumps({"style": "assert", "setup": str(setup or ""), "cases": asserts[:MAX_CASES]})
    return {
        "question": question,
        "tests": tests,
        "code_answer": str(row.get("code") or tests),
        "instruction": FUNCTION_INSTRUCTION,
        "task_id": row.get("task_id"),
    }


def humaneval_row(row: Mapping[str, Any]) -> dict[str, Any] | None:
    signature, test, entry = row.get("prompt"), row.get("test"), row.get("entry_point")
    if not signature or not test or not entry:
        return None
    tests = json.dumps({"style": "assert", "setup": str(test), "cases": [f"check({entry})"]})
    question = "Complete this Python function:\n```python\n" + str(signature).rstrip() + "\n```"
    solution = str(signature) + str(row.get("canonical_solution") or "")
    return {
        "question": question,
        "tests": tests,
        "code_answer": solution,
        "instruction": FUNCTION_INSTRUCTION,
        "task_id": row.get("task_id"),
    }


ROW_FORMS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any] | None]] = {
    "apps": apps_row,
    "mbpp": mbpp_row,
    "humaneval": humaneval_row,
}
