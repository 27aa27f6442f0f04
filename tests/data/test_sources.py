"""Sources: JSONL / Parquet with field names, TFDS, synthetic specs, and bad input."""

from __future__ import annotations

import json
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl4llm.data.records import DataError, Record
from jaxrl4llm.data.sources import SyntheticSource, make_source


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_gsm8k_style_with_default_fields(tmp_path):
    path = _write_jsonl(
        tmp_path / "gsm8k.jsonl",
        [{"question": "1+1?", "answer": "so #### 2"}, "", {"question": "2+2?", "answer": 4}],
    )
    source = make_source(path)
    assert len(source) == 2
    assert source[0] == Record("1+1?", "so #### 2", {"task": "math", "origin": f"{path}:1"})
    assert source[1].answer == "4" and source[1].metadata["origin"] == f"{path}:3"


def test_jsonl_custom_fields_split_placeholder_and_task_field(tmp_path):
    _write_jsonl(
        tmp_path / "test.jsonl",
        [
            {
                "q": "Use [3, 4] to make 12",
                "sol": "3*4",
                "kind": "countdown",
                "nums": [3, 4],
                "target": 12,
            }
        ],
    )
    source = make_source(
        "jsonl:" + str(tmp_path / "{split}.jsonl"),
        split="test",
        prompt_field="q",
        answer_field="sol",
        task_field="kind",
    )
    record = source[0]
    assert (record.prompt, record.answer, record.task) == (
        "Use [3, 4] to make 12",
        "3*4",
        "countdown",
    )
    assert record.metadata["nums"] == [3, 4] and record.metadata["target"] == 12


def test_record_dict_rows_round_trip(tmp_path):
    records = [Record("copy 3", "3", {"task": "arithmetic", "id": 7})]
    path = _write_jsonl(tmp_path / "records.jsonl", [r.to_dict() for r in records])
    loaded = make_source(path)[0]
    assert (loaded.prompt, loaded.answer, loaded.task, loaded.metadata["id"]) == (
        "copy 3",
        "3",
        "arithmetic",
        7,
    )


def test_parquet_numina_style(tmp_path):
    table = pa.table(
        {
            "problem": ["Find x.", "Find y."],
            "solution": ["... \\boxed{3}", "... \\boxed{\\frac{1}{2}}"],
            "source": ["amc", "aime"],
        }
    )
    pq.write_table(table, tmp_path / "part-0.parquet")
    source = make_source(str(tmp_path / "*.parquet"))
    assert [r.prompt for r in source] == ["Find x.", "Find y."]
    assert source[1].answer == "... \\boxed{\\frac{1}{2}}"  # the verifier takes the last box
    assert source[1].metadata["source"] == "aime"
    assert source[1].metadata["origin"].endswith("part-0.parquet:row 2")


@pytest.mark.parametrize(
    "rows,match",
    [
        (
            [{"question": "a", "answer": "1"}, '{"question": "b", "answer": '],
            r"bad\.jsonl:2: malformed JSON",
        ),
        (
            [{"question": "a", "answer": "1"}, {"question": "b"}],
            r"bad\.jsonl:2: missing or empty field 'answer'",
        ),
        (
            [{"question": "a", "answer": "1"}, {"question": "  ", "answer": "2"}],
            r"bad\.jsonl:2: missing or empty field 'question'",
        ),
        ([{"text": "a", "label": "1"}], r"bad\.jsonl:1: no prompt field.*prompt_field="),
        ([[1, 2]], r"bad\.jsonl:1: expected a JSON object"),
        ([], r"bad\.jsonl: the dataset is empty"),
    ],
)
def test_bad_jsonl_names_file_line_and_field(tmp_path, rows, match):
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=match):
        make_source(path)


def test_missing_file_and_unknown_options(tmp_path):
    with pytest.raises(DataError, match="no file matches"):
        make_source(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="valid: prompt_field"):
        make_source(str(tmp_path / "nope.jsonl"), question_field="q")
    with pytest.raises(DataError, match="cannot tell the kind"):
        make_source("data.csv")


def test_synthetic_spec():
    source = make_source(
        "synthetic:arithmetic?digits=1&ops=+-*&num_operands=3&n=7&seed=3", split="test"
    )
    assert isinstance(source, SyntheticSource) and len(source) == 7
    assert source.config.ops == "+-*" and source.config.digits == 1  # '+' stays literal
    assert all(r.metadata["split"] == "test" and r.task == "arithmetic" for r in source)
    assert source[6] == source[-1]
    with pytest.raises(IndexError):
        source[7]
    with pytest.raises(DataError, match="now a reasoning-gym task: write gym:knights_knaves"):
        make_source("synthetic:knights_knaves?min_people=8&max_people=8&n=2")


@pytest.mark.parametrize(
    "spec,match",
    [
        ("synthetic:sudoku", "valid: arithmetic, code, countdown"),
        ("synthetic:arithmetic?level=3", "unknown option 'level=3'; valid: digits"),
        ("synthetic:arithmetic?digits=two", "digits='two' is not a valid int"),
        ("synthetic:arithmetic?allow_negative=maybe", "not a valid bool"),
        ("synthetic:arithmetic?n=0", "n must be >= 1"),
    ],
)
def test_synthetic_spec_errors_list_valid_choices(spec, match):
    with pytest.raises(DataError, match=match):
        make_source(spec)


def test_tfds_needs_the_extra_or_reads_through_data_source(monkeypatch):
    if "tensorflow_datasets" not in sys.modules:
        monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
        with pytest.raises(ImportError, match=r"pip install -e '\.\[tfds\]'"):
            make_source("tfds:gsm8k")
    fake = types.ModuleType("tensorflow_datasets")
    calls = {}

    def data_source(name, split, data_dir=None):
        calls.update(name=name, split=split, data_dir=data_dir)
        return [{"question": b"What is 2+3?", "answer": b"... #### 5"}]

    fake.data_source = data_source
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", fake)
    source = make_source("tfds:gsm8k", split="test", data_dir="/data")
    assert calls == {"name": "gsm8k", "split": "test", "data_dir": "/data"}
    assert (len(source), source[0].prompt, source[0].answer) == (1, "What is 2+3?", "... #### 5")


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"question": "a", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid UTF-8 .*column 18"):
        make_source(str(path))


def test_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"question": "a", "answer": "1"}\r\n'
        b'{"question": "\xc3\xa9", "answer": "2"}\r\n'
    )
    source = make_source(str(path))
    assert [(r.prompt, r.answer) for r in source] == [("a", "1"), ("é", "2")]


@pytest.mark.parametrize(
    "rows,options,match",
    [
        (
            [{"question": "a", "answer": "1"}, {"question": "b", "answer": "2", "task": "chess"}],
            {},
            r"bad\.jsonl:2: unknown task 'chess'; valid: .*arithmetic.*countdown",
        ),
        (
            [{"question": "a", "answer": "1", "metadata": {"task": "algebra"}}],
            {},
            r"bad\.jsonl:1: unknown task 'algebra'",
        ),
        ([{"question": "a", "answer": "1"}], {"task": "geometry"}, r"bad\.jsonl:1: unknown task"),
    ],
)
def test_unknown_task_is_rejected_at_load_time(tmp_path, rows, options, match):
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=match):
        make_source(path, **options)
