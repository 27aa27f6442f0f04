"""Rows of a data file -> Records: the readers (JSONL, Parquet), the field picking and the
checks every file-backed source shares (local files, hub repositories, benchmarks, gym
options). The sources (sources.py, hub.py, benchmarks.py, gym.py) build on this module and
never on each other's helpers."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Iterable, Mapping, Sequence
from urllib.parse import unquote

from jaxrl4llm.data.records import DataError, Record
from jaxrl4llm.rewards.registry import TASK_VERIFIERS

PROMPT_FIELDS = ("prompt", "question", "problem", "query", "input")
ANSWER_FIELDS = ("answer", "final_answer", "solution", "target", "output")


@dataclasses.dataclass(frozen=True)
class FieldNames:
    prompt_field: str | None = None  # None: the first of PROMPT_FIELDS the first row has
    answer_field: str | None = None  # None: the first of ANSWER_FIELDS the first row has
    task_field: str = "task"  # a row field naming its task, if present
    task: str = "math"  # the task of rows without `task_field`


class ListSource(Sequence[Record]):
    counts: dict[str, int]  # only a registered benchmark's (rows read, dropped, kept)

    def __init__(self, records: list[Record], name: str):
        self.records, self.name = records, name

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):  # grain calls this with ints only
        return self.records[index]

    def __repr__(self) -> str:
        return f"ListSource({self.name!r}, {len(self)} records)"


def convert_option(value: str, kind: Any, name: str, valid: str) -> Any:
    try:
        if kind is bool:
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("1", "true", "yes")
        return kind(value)
    except ValueError:
        raise DataError(
            f"option {name}={value!r} is not a valid {kind.__name__}; valid options: {valid}"
        ) from None


def parse_query_options(
    query: str,
    kinds: Mapping[str, Any],
    convert: Callable[[str, Any, str], Any],
    where: str,
    valid: str,
) -> dict[str, Any]:
    """A spec's query 'a=1&b=x' -> {name: convert(value, kinds[name], name)}; names and values
    are %-decoded ('+' stays literal). An option without '=' or not in `kinds` fails naming
    the spec (`where`) and the `valid` options."""
    options: dict[str, Any] = {}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        key, value = unquote(key), unquote(value)
        if not eq or key not in kinds:
            raise DataError(f"{where}: unknown option {item!r}; valid: {valid}")
        options[key] = convert(value, kinds[key], key)
    return options


def pick_field(
    row: Mapping[str, Any], given: str | None, candidates: Sequence[str], role: str, where: str
) -> str:
    if given is not None:
        return given
    for name in candidates:
        if name in row:
            return name
    raise DataError(
        f"{where}: no {role} field; looked for {', '.join(candidates)} but the row "
        f"has {', '.join(sorted(row)) or 'no fields'}; pass {role}_field=..."
    )


def rows_to_records(
    rows: Iterable[tuple[str, Mapping[str, Any]]], fields: FieldNames, name: str
) -> list[Record]:
    """(location, row) pairs -> Records; errors name the location ('file:line') and the field."""
    records: list[Record] = []
    prompt_key = answer_key = None
    for where, row in rows:
        if not isinstance(row, Mapping):
            raise DataError(f"{where}: expected a JSON object per row, got {type(row).__name__}")
        prompt_key = prompt_key or pick_field(
            row, fields.prompt_field, PROMPT_FIELDS, "prompt", where
        )
        answer_key = answer_key or pick_field(
            row, fields.answer_field, ANSWER_FIELDS, "answer", where
        )
        values = {}
        for role, key in (("prompt", prompt_key), ("answer", answer_key)):
            value = row.get(key)
            if value is None or (isinstance(value, str) and not value.strip()):
                raise DataError(
                    f"{where}: missing or empty field {key!r} ({role}); the row has "
                    f"{', '.join(sorted(row))}; fix the row or pass {role}_field=..."
                )
            if isinstance(value, bytes):
                value = value.decode("utf-8", errors="replace")
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise DataError(
                    f"{where}: field {key!r} ({role}) must be text or a number, got "
                    f"{type(value).__name__}"
                )
            values[role] = str(value)
        metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
        if isinstance(row.get("metadata"), Mapping):  # a Record.to_dict() row: flatten it
            metadata.update(metadata.pop("metadata"))
        metadata["task"] = str(row.get(fields.task_field) or metadata.get("task") or fields.task)
        if metadata["task"] not in TASK_VERIFIERS:
            raise DataError(
                f"{where}: unknown task {metadata['task']!r}; valid: "
                f"{', '.join(TASK_VERIFIERS)}; fix the row's {fields.task_field!r} "
                "field or pass task=..."
            )
        metadata["origin"] = where
        records.append(Record(values["prompt"], values["answer"], metadata))
    if not records:
        raise DataError(f"{name}: the dataset is empty (no rows); check the file / split")
    return records


def decode_line(raw: bytes, path: str, line_no: int) -> str:
    """One JSONL line as text: UTF-8 (a byte-order mark on line 1 accepted)."""
    try:
        return raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}:{line_no}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at "
            f"column {exc.start + 1}); re-encode the file as UTF-8, e.g. "
            f"iconv -f latin1 -t utf-8"
        ) from None


def jsonl_rows(path: str) -> Iterable[tuple[str, Any]]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            line = decode_line(raw, path, line_no)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{line_no}: malformed JSON ({exc.msg} at column "
                    f"{exc.colno}); each line must be one JSON object"
                ) from None
            yield f"{path}:{line_no}", row


def parquet_rows(path: str, where: str | None = None) -> Iterable[tuple[str, Any]]:
    """(location, row) pairs of one Parquet file; `where` names it in locations and errors."""
    import pyarrow.parquet as pq

    where = where or path
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types
        raise DataError(f"{where}: not a readable Parquet file ({exc})") from None
    for row_no, row in enumerate(table.to_pylist(), 1):
        yield f"{where}:row {row_no}", row
