"""Correctness corpus of the code verifier: (program, tests, expected verdict) cases written by
hand, judged in the sandbox; the verifier must agree on at least 99% of them (it agrees on all
of them today: the threshold is the issue's acceptance bar).

Families: stdin/stdout problems with several cases each, times program variants (right,
trailing whitespace, missing or extra final newlines, debug output on stderr (fine) or on
stdout (wrong), floating-point output within and beyond 1e-6, wrong answers, crashes, time-outs),
and assert-style problems (right, wrong, raising, exit(0) before the tests, partly right)."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from jaxrl4llm.rewards import sandbox
from jaxrl4llm.rewards.code import (
    CodeConfig,
    CodeVerifier,
    extract_code,
    outputs_match,
    run_code_tests,
)

LAYER = sandbox.available_layer()
CONFIG = sandbox.SandboxConfig(wall_s=1.0, cpu_s=1)


def stdio(*pairs):
    return json.dumps({"style": "stdio", "cases": [{"input": i, "output": o} for i, o in pairs]})


SUM = stdio(("1 2\n", "3\n"), ("10 -4\n", "6\n"), ("0 0\n", "0\n"))
DIVIDE = stdio(("1 3\n", "0.333333333\n"), ("2 7\n", "0.285714286\n"), ("9 3\n", "3.000000000\n"))
REVERSE_LINES = stdio(("3\na\nb\nc\n", "c\nb\na\n"), ("1\nx\n", "x\n"))
COUNT = stdio(("5\n1 2 3 4 5\n", "15 5\n"), ("2\n7 7\n", "14 2\n"))
YESNO = stdio(("4\n", "YES\n"), ("7\n", "NO\n"), ("0\n", "YES\n"))
SQRT = stdio(("2\n", "1.41421356\n"), ("10\n", "3.16227766\n"))

READ_SUM = "a, b = map(int, input().split())\n"
READ_DIV = "a, b = map(int, input().split())\n"
READ_LINES = "import sys\nn = int(input())\nrows = [input() for _ in range(n)]\n"
READ_COUNT = "input()\nxs = list(map(int, input().split()))\n"
READ_N = "n = int(input())\n"
CORPUS: list[tuple[str, str, str, str]] = []  # (name, program, tests, expected reason)


def add(name, program, tests, expected):
    CORPUS.append((name, program, tests, expected))


for problem, read, tests, right, wrong, float_like in (
    ("sum", READ_SUM, SUM, "a + b", "a - b", False),
    ("divide", READ_DIV, DIVIDE, "a / b", "a // b", True),
    ("count", READ_COUNT, COUNT, "f'{sum(xs)} {len(xs)}'", "f'{len(xs)} {sum(xs)}'", False),
    (
        "yesno",
        READ_N,
        YESNO,
        "'YES' if n % 2 == 0 else 'NO'",
        "'yes' if n % 2 == 0 else 'no'",
        False,
    ),
    ("sqrt", "import math\n" + READ_N, SQRT, "math.sqrt(n)", "math.sqrt(n) + 1e-3", True),
):
    add(f"{problem}/right", f"{read}print({right})", tests, "correct")
    add(f"{problem}/trailing_spaces", f"{read}print(str({right}) + '   ')", tests, "correct")
    add(
        f"{problem}/no_final_newline",
        f"{read}import sys\nsys.stdout.write(str({right}))",
        tests,
        "correct",
    )
    add(f"{problem}/extra_blank_lines", f"{read}print({right})\nprint()\nprint()", tests, "correct")
    add(
        f"{problem}/crlf",
        f"{read}import sys\nsys.stdout.write(str({right}) + '\\r\\n')",
        tests,
        "correct",
    )
    add(
        f"{problem}/debug_on_stderr",
        f"{read}import sys\nprint('debug', file=sys.stderr)\nprint({right})",
        tests,
        "correct",
    )
    add(
        f"{problem}/debug_on_stdout",
        f"{read}print('debug:', {right})\nprint({right})",
        tests,
        "wrong",
    )
    add(
        f"{problem}/leading_debug_line",
        f"{read}print('reading done')\nprint({right})",
        tests,
        "wrong",
    )
    add(f"{problem}/wrong", f"{read}print({wrong})", tests, "wrong")
    add(
        f"{problem}/crash_after_print",
        f"{read}print({right})\nraise ValueError('late')",
        tests,
        "wrong",
    )
    add(f"{problem}/crash_before", f"{read}raise ValueError('early')", tests, "wrong")
    add(f"{problem}/too_slow", f"{read}import time\ntime.sleep(3)\nprint({right})", tests, "wrong")
    add(f"{problem}/nothing", f"{read}pass", tests, "wrong")
    add(f"{problem}/twice", f"{read}print({right})\nprint({right})", tests, "wrong")
    add(f"{problem}/exit_zero_silent", "import sys\nsys.exit(0)", tests, "wrong")
    if float_like:
        add(f"{problem}/six_decimals", f"{read}print(f'{{{right}:.6f}}')", tests, "correct")
        add(f"{problem}/twelve_decimals", f"{read}print(f'{{{right}:.12f}}')", tests, "correct")
        add(f"{problem}/two_decimals", f"{read}print(f'{{{right}:.2f}}')", tests, "wrong")
        add(f"{problem}/four_decimals", f"{read}print(f'{{{right}:.4f}}')", tests, "wrong")
        add(f"{problem}/scientific", f"{read}print(f'{{{right}:.10e}}')", tests, "correct")

add("reverse/right", READ_LINES + "print('\\n'.join(reversed(rows)))", REVERSE_LINES, "correct")
add("reverse/forward", READ_LINES + "print('\\n'.join(rows))", REVERSE_LINES, "wrong")
add("reverse/one_line", READ_LINES + "print(' '.join(reversed(rows)))", REVERSE_LINES, "wrong")
add(
    "reverse/indented",
    READ_LINES + "print('\\n'.join('  ' + r for r in reversed(rows)))",
    REVERSE_LINES,
    "correct",
)
add(
    "reverse/blank_line_between",
    READ_LINES + "print('\\n\\n'.join(reversed(rows)))",
    REVERSE_LINES,
    "wrong",
)
add("sum/int_as_float", READ_SUM + "print(float(a + b))", SUM, "correct")
add("sum/big_off_by_one", READ_SUM + "print(a + b + (1 if a == 10 else 0))", SUM, "wrong")
add(
    "sum/reads_all_stdin",
    "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)",
    SUM,
    "correct",
)
add(
    "sum/helper_function",
    "def solve(a, b):\n    return a + b\n\nif __name__ == '__main__':\n"
    "    print(solve(*map(int, input().split())))",
    SUM,
    "correct",
)
add("sum/syntax_error", "print(a +)", SUM, "wrong")
add("sum/infinite_loop", "while True:\n    pass", SUM, "wrong")
add("sum/memory_bomb", "x = bytearray(10 ** 11)\nprint(3)", SUM, "wrong")


def asserts(*cases, setup=""):
    return json.dumps({"style": "assert", "setup": setup, "cases": list(cases)})


ADD = asserts("assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0")
PALINDROME = asserts(
    "assert is_palindrome('racecar')", "assert not is_palindrome('ab')", "assert is_palindrome('')"
)
FIB = asserts(
    "assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55", "assert fib(20) == 6765"
)
CLOSE = asserts(
    "def check(candidate):\n    assert candidate([1.0, 2.0, 3.9], 0.3) is False\n"
    "    assert candidate([1.0, 2.8, 3.0], 0.3) is True\n"
    "check(has_close_elements)"
)
for problem, tests, right, wrong in (
    ("add", ADD, "def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b"),
    (
        "palindrome",
        PALINDROME,
        "def is_palindrome(s):\n    return s == s[::-1]",
        "def is_palindrome(s):\n    return s == sorted(s)",
    ),
    (
        "fib",
        FIB,
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b"
        "\n    return a",
        "def fib(n):\n    return n",
    ),
    (
        "close",
        CLOSE,
        "def has_close_elements(xs, t):\n    return any(abs(a - b) < t for i, a in"
        " enumerate(xs) for b in xs[i + 1:])",
        "def has_close_elements(xs, t):\n    return True",
    ),
):
    add(f"{problem}/right", right, tests, "correct")
    add(f"{problem}/right_with_prints", "print('hello')\n" + right, tests, "correct")
    add(f"{problem}/wrong", wrong, tests, "wrong")
    add(
        f"{problem}/raises", right.split("\n")[0] + "\n    raise RuntimeError('no')", tests, "wrong"
    )
    add(f"{problem}/missing_function", "def something_else():\n    pass", tests, "wrong")
    add(f"{problem}/exit_zero_hack", right + "\nimport sys\nsys.exit(0)", tests, "wrong")
    add(f"{problem}/os_exit_hack", "import os\nos._exit(0)", tests, "wrong")
    add(f"{problem}/slow", "import time\ntime.sleep(3)\n" + right, tests, "wrong")
    add(f"{problem}/main_guard", right + "\nif __name__ == '__main__':\n    pass", tests, "correct")
add("add/patches_assert", "import builtins\ndef add(a, b):\n    return 0", ADD, "wrong")
add(
    "fib/recursive_right",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    FIB,
    "correct",
)
add(
    "add/uses_setup",
    "def add(a, b):\n    return OFFSET + a + b - OFFSET",
    asserts("assert add(1, 2) == 3", setup="OFFSET = 5"),
    "correct",
)


def _verdict(case):
    name, program, tests, expected = case
    reason, _, detail = run_code_tests(program, tests, "all_pass", CONFIG, LAYER, 30.0)
    return name, expected, reason, detail


@pytest.mark.skipif(LAYER is None, reason="no isolation layer (bwrap, unshare) here")
def test_corpus_agreement():
    assert len(CORPUS) >= 100
    assert len({name for name, *_ in CORPUS}) == len(CORPUS)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        found = list(pool.map(_verdict, CORPUS))
    disagreements = [(n, e, r, d) for n, e, r, d in found if e != r]
    assert len(disagreements) <= 0.01 * len(CORPUS), disagreements
    assert {e for _, e, _, _ in found} == {"correct", "wrong"}


@pytest.mark.parametrize(
    "actual, expected, match",
    [
        ("3\n", "3", True),
        ("3 \n\n", "3\n", True),
        ("3.0000001\n", "3\n", True),
        ("1000001\n", "1000000\n", False),
        ("0.3334\n", "0.333333333\n", False),
        ("1e-7\n", "0\n", True),
        ("nan\n", "nan\n", True),
        ("YES\n", "yes\n", False),
        ("1 2\n", "1  2\n", True),
        ("1\n2\n", "1 2\n", False),
        ("", "\n", True),
        ("", "0\n", False),
    ],
)
def test_outputs_match(actual, expected, match):
    assert outputs_match(actual, expected) is match


@pytest.mark.parametrize(
    "completion, code",
    [
        ("text\n```python\nprint(1)\n```\n", "print(1)\n"),
        ("```py\na\n```\n```python\nb\n```", "b\n"),
        ("```python\nfirst\n```\nthen ```python\ntruncated", "first\n"),
        ("```\nuntagged\n```", "untagged\n"),
        ("```cpp\nint main(){}\n```", None),
        ("```python\nkept\n```\n```bash\nls\n```", "kept\n"),
        ("no code at all", None),
        ("```python\n```", ""),
    ],
)
def test_extract_code(completion, code):
    assert extract_code(completion) == code


def test_extract_code_is_linear_on_hostile_fences():
    import time

    text = "```python\n" * 50_000 + "x" * 100_000
    start = time.perf_counter()
    extract_code(text)
    assert time.perf_counter() - start < 1.0


def test_verifier_reports_missing_and_overlong_code():
    verifier = CodeVerifier(CodeConfig(max_code_chars=10))
    record = {"metadata": {"task": "code", "tests": SUM}}
    assert verifier.plan_one("no fence", record).reason == "no_answer"
    assert verifier.plan_one("```python\n" + "x" * 20 + "\n```", record).reason == "parse_error"
    with pytest.raises(ValueError, match="metadata\\['tests'\\]"):
        verifier.plan_one("```python\nx\n```", {"metadata": {}})
