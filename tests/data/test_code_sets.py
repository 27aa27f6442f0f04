"""Code data: the registry's code sets (rows in their published schemas, read offline from a
hub-cache fixture) and the procedural code task; their tests pass a correct program and fail a
wrong one in the sandbox."""

from __future__ import annotations

import json
import re

import pytest

from jaxrl4llm.data.benchmarks import BENCHMARKS
from jaxrl4llm.data.records import DataError
from jaxrl4llm.data.sources import make_source
from jaxrl4llm.rewards import sandbox
from jaxrl4llm.rewards.code import CodeConfig, CodeVerifier

from tests.data.hub_fixtures import readme, write_repo

needs_sandbox = pytest.mark.skipif(
    sandbox.available_layer() is None, reason="no isolation layer (bwrap, unshare) here"
)

HUMANEVAL = [
    {
        "task_id": "HumanEval/0",
        "prompt": "def add(a: int, b: int) -> int:\n"
        '    """Return the sum of a and b.\n    >>> add(2, 3)\n    5\n    """\n',
        "canonical_solution": "    return a + b\n",
        "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n"
        "    assert candidate(-1, 1) == 0\n",
        "entry_point": "add",
    },
]
MBPP_FULL = [
    {
        "task_id": 11,
        "text": "Write a python function to remove first and last occurrence of a "
        "given character from the string.",
        "code": "def remove_Occ(s,ch): \r\n    s = s.replace(ch, '', 1)\r\n    i = s.rfind(ch)\r\n"
        "    if i >= 0:\r\n        s = s[:i] + s[i + 1:]\r\n    return s ",
        "test_list": [
            'assert remove_Occ("hello","l") == "heo"',
            'assert remove_Occ("abcda","a") == "bcd"',
            'assert remove_Occ("PHP","P") == "H"',
        ],
        "test_setup_code": "",
        "challenge_test_list": [],
    },
    {
        "task_id": 12,
        "text": "Write a function with no tests.",
        "code": "def f(): pass",
        "test_list": [],
        "test_setup_code": "",
        "challenge_test_list": [],
    },
]
APPS = [
    {
        "problem_id": 4000,
        "question": "Given two integers, print their product.\n",
        "solutions": json.dumps(["a, b = map(int, input().split())\nprint(a * b)\n"]),
        "input_output": json.dumps({"inputs": ["3 4\n", "-2 5\n"], "outputs": ["12\n", "-10\n"]}),
        "difficulty": "introductory",
        "url": "https://codeforces.com/problemset/problem/0/A",
        "starter_code": "",
    },
    {
        "problem_id": 4001,
        "question": "Lines in, lines out.",
        "solutions": "[]",
        "input_output": json.dumps({"inputs": [["1", "2"]], "outputs": [["3"]]}),
        "difficulty": "interview",
        "url": "",
        "starter_code": "",
    },
    {
        "problem_id": 4002,
        "question": "Call-based.",
        "solutions": "[]",
        "input_output": json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [2]}),
        "difficulty": "interview",
        "url": "",
        "starter_code": "def f(x):",
    },
]
CODE_REPOS = {
    "openai/openai_humaneval": (
        [{"name": "openai_humaneval", "files": {"test": "openai_humaneval/test-*"}}],
        {"openai_humaneval/test-00000-of-00001.parquet": HUMANEVAL},
    ),
    "google-research-datasets/mbpp": (
        [
            {
                "name": "full",
                "default": True,
                "files": {"train": "full/train-*", "test": "full/test-*"},
            }
        ],
        {
            "full/train-00000-of-00001.parquet": MBPP_FULL,
            "full/test-00000-of-00001.parquet": MBPP_FULL[:1],
        },
    ),
    "codeparrot/apps": (None, {"train.jsonl": APPS, "test.jsonl": APPS[:1]}),
}
WRONG = (
    "```python\nprint(0)\ndef add(a, b):\n    return 0\ndef remove_Occ(s, ch):\n    return s\n```"
)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for repo, (configs, files) in CODE_REPOS.items():
        files = dict(files)
        if configs is not None:
            files["README.md"] = readme(configs)
        write_repo(str(tmp_path), repo, files)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


def test_code_entries_name_their_licence():
    code = {name: b for name, b in BENCHMARKS.items() if b.task == "code"}
    assert set(code) == {"humaneval", "mbpp", "apps"}
    assert {b.licence for b in code.values()} <= {"MIT", "CC-BY-4.0"}


def test_humaneval_loads_offline_as_an_assert_task(offline):
    source = make_source("humaneval", split="test")
    record = source[0]
    assert record.task == "code" and "def add(a: int, b: int)" in record.prompt
    assert json.loads(record.metadata["tests"])["cases"] == ["check(add)"]
    assert record.answer == (HUMANEVAL[0]["prompt"] + HUMANEVAL[0]["canonical_solution"]).strip()


def test_mbpp_shows_the_tests_and_drops_rows_without_any(offline):
    source = make_source("mbpp", split="train")
    assert source.counts == {"rows": 2, "dropped": 1, "kept": 1}
    record = source[0]
    assert record.prompt.endswith('assert remove_Occ("PHP","P") == "H"')
    tests = json.loads(record.metadata["tests"])
    assert tests["style"] == "assert" and tests["cases"] == MBPP_FULL[0]["test_list"]


def test_apps_keeps_stdin_problems_and_joins_line_lists(offline):
    source = make_source("apps", split="train")
    assert source.counts == {"rows": 3, "dropped": 1, "kept": 2}
    first, lines = (json.loads(r.metadata["tests"]) for r in source)
    assert first == {
        "style": "stdio",
        "cases": [{"input": "3 4\n", "output": "12\n"}, {"input": "-2 5\n", "output": "-10\n"}],
    }
    assert lines["cases"] == [{"input": "1\n2\n", "output": "3\n"}]
    assert source[0].answer.startswith("a, b = map(int")
    assert source[1].answer == source[1].metadata["tests"]  # no reference solution: the tests


def test_a_code_set_offline_without_its_files_names_the_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="hf download"):
        make_source("mbpp", split="test")


@needs_sandbox
@pytest.mark.parametrize(
    "name,split", [("humaneval", "test"), ("mbpp", "train"), ("apps", "train")]
)
def test_reference_solutions_pass_and_a_wrong_program_fails(offline, name, split):
    verifier = CodeVerifier(CodeConfig())
    record = make_source(name, split=split)[0]
    right = verifier.verify_one(_fenced(record.answer), record)
    wrong = verifier.verify_one(WRONG, record)
    assert (right.reason, right.score) == ("correct", 1.0), right.detail
    assert (wrong.reason, wrong.score) == ("wrong", 0.0)


# ---- the procedural task ---------------------------------------------------------------


def _expected_output(question: str, text: str) -> str:
    """The answer to a generated question, worked out from its wording alone."""
    if m := re.fullmatch(r"Read an integer n .* print n \* (\d+) \+ (\d+)\.", question):
        return str(int(text) * int(m[1]) + int(m[2]))
    if m := re.search(r"print a \+ b \+ (\d+)\.$", question):
        a, b = text.split()
        return str(int(a) + int(b) + int(m[1]))
    if m := re.search(r"largest of them multiplied by (\d+)\.$", question):
        return str(max(int(v) for v in text.split()) * int(m[1]))
    if m := re.search(r"the letter '(\w)' appears", question):
        return str(sum(1 for ch in text if ch == m[1]))
    if m := re.search(r"print it (\d+) times, joined by '(.)'\.$", question):
        return m[2].join(text for _ in range(int(m[1])))
    raise AssertionError(f"unrecognised question {question!r}")


def test_synthetic_code_tests_match_the_question():
    source = make_source("synthetic:code?n=60&cases=4", split="train")
    kinds = set()
    for record in source:
        tests = json.loads(record.metadata["tests"])
        assert record.task == "code" and tests["style"] == "stdio" and len(tests["cases"]) == 4
        for case in tests["cases"]:
            assert case["output"] == _expected_output(record.prompt, case["input"].strip()) + "\n"
        kinds.add(record.metadata["kind"])
    assert kinds == {"linear", "sum", "max_times", "count_letter", "repeat"}


def test_synthetic_code_is_deterministic_and_splits_do_not_share_questions():
    train = make_source("synthetic:code?n=200&kinds=linear,sum", split="train")
    again = make_source("synthetic:code?n=200&kinds=linear,sum", split="train")
    test = make_source("synthetic:code?n=50&kinds=linear,sum", split="test")
    assert [r.to_dict() for r in train] == [r.to_dict() for r in again]
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    assert {r.metadata["kind"] for r in train} == {"linear", "sum"}


def test_synthetic_code_options_are_checked():
    with pytest.raises(DataError, match="valid: linear,sum,max_times"):
        make_source("synthetic:code?kinds=linear,sort")
    with pytest.raises(DataError, match="cases must be in 1..20"):
        make_source("synthetic:code?cases=0")


@needs_sandbox
def test_synthetic_reference_programs_pass_their_tests():
    verifier = CodeVerifier(CodeConfig())
    for record in make_source("synthetic:code?n=10", split="train"):
        verdict = verifier.verify_one(_fenced(record.answer), record)
        assert verdict.reason == "correct", (record.prompt, verdict.detail)
        assert verifier.verify_one(WRONG, record).reason == "wrong"
