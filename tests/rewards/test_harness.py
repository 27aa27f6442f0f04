"""The assert-style verdict protocol without a sandbox: how a case splits into holes (sent to
the program) and checks (decided here), what the program's report decodes to, and how the
checks are decided over it (rewards/harness.py, rewards/verdict.py)."""

from __future__ import annotations

import json
import math

import pytest

from jaxrl4llm.rewards import harness, verdict

HUMANEVAL_SETUP = (
    "METADATA = {'author': 'jt'}\n\ndef check(candidate):\n"
    "    assert candidate([1.0, 2.0, 3.9], 0.3) == True\n"
    "    assert not candidate([1.0, 2.0], 0.05)\n"
    "    assert abs(candidate([1.0], 0.5) - 0) < 1e-6\n"
    "    assert True, 'a message'\n"
)


def plan(case, setup="", program="def add(a, b): return a + b"):
    return harness.plan_case(case, setup, harness.program_names(program))


@pytest.mark.parametrize(
    "case, setup, holes",
    [
        ("assert add(1, 2) == 3", "", ["add(1, 2)"]),
        ("assert not is_even(3)", "", ["is_even(3)"]),
        ("assert math.isclose(area(2), 12.56, rel_tol=0.01)", "import math", ["area(2)"]),
        ("assert isclose(area(2), 12.56)", "from math import isclose", ["area(2)"]),
        ("assert set(f([1, 2])) == {2, 1}", "", ["f([1, 2])"]),
        ("assert sorted(f(x)) == [1, 2]", "x = [2, 1]", ["f(x)"]),
        ("assert 0 < f(1) <= 5 and f(2) is None", "", ["f(1)", "f(2)"]),
        ("assert f(1)[0] == 'a'", "", ["f(1)"]),
        ("assert f(1).lower() == 'a'", "", ["f(1).lower()"]),
        ("assert f(1) == f(2)", "", ["f(1)", "f(2)"]),
        ("check(has_close)", HUMANEVAL_SETUP, ["has_close([1.0, 2.0, 3.9], 0.3)"] * 1),
    ],
)
def test_a_case_splits_into_holes_and_checks(case, setup, holes):
    found = plan(case, setup)
    assert found.problem == ""
    assert list(found.holes[: len(holes)]) == holes
    for hole in found.holes:  # the expected values stay here
        assert "12.56" not in hole and "== " not in hole


def test_a_test_function_is_unfolded_and_never_sent():
    found = plan("check(has_close)", HUMANEVAL_SETUP)
    assert len(found.checks) == 4 and len(found.holes) == 3
    assert "def check" not in found.setup and "METADATA" in found.setup
    assert "3.9], 0.3) == True" not in found.setup
    assert verdict.decide(found, [True, False, 0.0])[0]
    assert not verdict.decide(found, [True, True, 0.0])[0]


@pytest.mark.parametrize(
    "case, setup, program, why",
    [
        ("x = 3", "", "", "unsupported test statement"),
        ("for i in range(3):\n    assert f(i) == i", "", "", "unsupported test statement"),
        ("assert f(1) == ref(1)", "def ref(x):\n    return x", "", "the test's own ref"),
        ("assert ref_ok(f(1))", "def ref_ok(x):\n    return True", "", "the test's own ref_ok"),
        ("assert abs(f(1) - 2) < 1e-9", "", "def abs(x):\n    return 0", "redefines abs"),
        ("assert f(1) ==", "", "", "does not parse"),
    ],
)
def test_what_cannot_be_decided_here_fails(case, setup, program, why):
    assert why in plan(case, setup, program).problem


def test_a_reference_value_the_setup_computes_is_fine_when_compared_with_a_literal():
    assert plan("assert ref(f(1)) == 3", "def ref(x):\n    return x").problem == ""


@pytest.mark.parametrize(
    "case, values, passed",
    [
        ("assert add(1, 2) == 3", [3], True),
        ("assert add(1, 2) == 3", [3.0], True),
        ("assert add(1, 2) == 3", ["3"], False),
        ("assert add(1, 2) == 3", [verdict.Raised("ZeroDivisionError: x")], False),
        ("assert math.isclose(add(0.1, 0.2), 0.3)", [0.30000000000000004], True),
        ("assert abs(add(2, 2) - 4) < 1e-9", [4], True),
        ("assert add(0, 0) is None", [None], True),
        ("assert list(add([1], [2])) == [1, 2]", [iter([1, 2])], True),
        ("assert add(1, 1) == 2 ** 20000", [2], False),  # too large: fails, never computed
        ("assert add(1, 2) == 3 or add(9, 9)", [3, verdict.Raised("x")], True),
    ],
)
def test_checks_are_decided_here(case, values, passed):
    found = plan(case, "import math")
    assert verdict.decide(found, values)[0] is passed


def _report(*values):
    return "program output\n" + harness.MARK + json.dumps([["ok", v] for v in values]) + "\n"


def test_the_report_decodes_to_plain_values_only():
    big = 3**10000  # 4,772 digits: more than int() reads from decimal text (4,300)
    values = verdict.read_values(
        _report(
            ["int", hex(big)],
            ["float", float("nan").hex()],
            ["tuple", [["int", "0x1"], "a"]],
            ["dict", [["b", ["set", [["int", "0x2"]]]]]],
            ["fraction", "0x1", "0x3"],
        ),
        5,
    )
    assert values is not None
    assert values[0] == big and math.isnan(values[1]) and values[2] == (1, "a")
    assert values[3] == {"b": {2}} and str(values[4]) == "1/3"


@pytest.mark.parametrize(
    "stdout",
    [
        "no report at all\n",
        _report(["int", "0x1"], ["int", "0x2"]),  # two values for one hole
        harness.MARK + '[["ok", 3]]\n',  # a bare JSON number is not a value
        harness.MARK + '[["ok", ["object", "x"]]]\n',
        harness.MARK + '[["maybe", true]]\n',
        harness.MARK + "[" * 100_000 + "\n",
    ],
)
def test_a_malformed_report_is_no_report(stdout):
    assert verdict.read_values(stdout, 1) is None


def test_the_last_report_counts():
    stdout = _report(["int", "0x3"]) + "later output\n" + _report(["int", "0x4"])
    assert verdict.read_values(stdout, 1) == [4]


def test_the_child_source_holds_no_expected_value():
    found = plan("assert add(1, 2) == 12345", "import math")
    source = harness.child_source("def add(a, b): return a + b", found)
    assert "12345" not in source and "add(1, 2)" in source
