"""Prompt sources by spec string; each is a random-access sequence of Records.

    make_source("synthetic:arithmetic?digits=2&ops=+-*")          procedural task (lazy)
    make_source("data/gsm8k_{split}.jsonl", split="test")          JSONL ('jsonl:' prefix optional)
    make_source("parquet:data/math/*.parquet", prompt_field="problem", answer_field="solution")
    make_source("tfds:gsm8k", split="train", data_dir="...")      TFDS-prepared data, no TensorFlow
    make_source("hf:openai/gsm8k:main", split="test")              a Hub dataset (data/hub.py)
    make_source("gym:knights_knaves?n_people=3")                   reasoning-gym (data/gym.py)
    make_source("math500", split="test")                           a registered name (benchmarks.py)

File paths may contain '{split}' and glob patterns. Field names default to the first of
PROMPT_FIELDS / ANSWER_FIELDS that the first row has; every other field goes into metadata (a
nested "metadata" object is merged in, so Record.to_dict() rows round-trip), with
metadata["task"] from the row's `task_field`, else the nested metadata's "task", else `task`.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import typing
from typing import Any, Mapping, Sequence

from jaxrl4llm.data.hub import HubSpec, hub_rows
from jaxrl4llm.data.records import DataError, Record
from jaxrl4llm.data.rows import (
    ANSWER_FIELDS,
    PROMPT_FIELDS,
    FieldNames,
    ListSource,
    convert_option,
    jsonl_rows,
    parquet_rows,
    parse_query_options,
    pick_field,
    rows_to_records,
)
from jaxrl4llm.data.tasks import TASKS, generate_record, get_task
from jaxrl4llm.data.tasks.common import canonical_split

SOURCE_KINDS = ("synthetic", "jsonl", "parquet", "tfds", "hf", "gym")
SYNTHETIC_OPTIONS = {"n": int, "seed": int, "test_fraction": float, "distinct": bool}
# distinct=true: scan at most this many indices per wanted question before giving up.
DISTINCT_SCAN = 200
DEFAULT_SIZES = {"train": 10_000, "test": 500}
TFDS_HINT = "pip install -e '.[tfds]'"


class SyntheticSource(Sequence[Record]):
    """`num_examples` records of a procedural task, each generated on access from its index."""

    def __init__(
        self,
        task: str,
        config: Any,
        split: str,
        seed: int,
        num_examples: int,
        test_fraction: float = 0.1,
        distinct: bool = False,
        exact_size: bool = True,
    ):
        if num_examples < 1:
            raise DataError(f"synthetic:{task}: n must be >= 1, got {num_examples}")
        self.task, self.config, self.split = task, config, canonical_split(split)
        self.seed, self.num_examples, self.test_fraction = seed, num_examples, test_fraction
        self.name = f"synthetic:{task}/{self.split}"
        # distinct: the examples are the first occurrences of their questions, in index order
        # (an eval set of N prompts is then N different questions).
        # Without an explicit n (exact_size=False) the set is every distinct question found,
        # at most num_examples.
        self._indices = self._distinct_indices(exact_size) if distinct else None
        if self._indices is not None:
            self.num_examples = len(self._indices)

    def _record(self, index: int) -> Record:
        return generate_record(
            self.task,
            self.config,
            seed=self.seed,
            split=self.split,
            index=index,
            test_fraction=self.test_fraction,
        )

    def _distinct_indices(self, exact_size: bool) -> list[int]:
        seen: set[str] = set()
        indices: list[int] = []
        for index in range(self.num_examples * DISTINCT_SCAN):
            question = self._record(index).prompt
            if question not in seen:
                seen.add(question)
                indices.append(index)
                if len(indices) == self.num_examples:
                    return indices
        if not exact_size and indices:
            return indices
        raise DataError(
            f"{self.name}: only {len(indices)} distinct {self.split} questions in "
            f"{self.num_examples * DISTINCT_SCAN} draws with {self.config} and "
            f"test_fraction={self.test_fraction}, fewer than n={self.num_examples}: lower n, "
            "raise test_fraction (a larger held-out share) or the difficulty knobs"
        )

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index):
        if not -self.num_examples <= index < self.num_examples:
            raise IndexError(index)
        index %= self.num_examples
        return self._record(index if self._indices is None else self._indices[index])

    def __repr__(self) -> str:
        return f"SyntheticSource({self.name!r}, {self.config}, seed={self.seed}, n={len(self)})"


def parse_synthetic(spec_body: str, split: str) -> SyntheticSource:
    """'arithmetic?digits=2&ops=+-*' -> SyntheticSource. '+' is literal (no form decoding)."""
    name, _, query = spec_body.partition("?")
    task = get_task(name)
    hints = typing.get_type_hints(task.config_cls)
    knobs = {f.name: hints[f.name] for f in dataclasses.fields(task.config_cls)}
    kinds = {**knobs, **SYNTHETIC_OPTIONS}
    valid = ", ".join(f"{k} ({'bool' if v is bool else v.__name__})" for k, v in kinds.items())
    options = parse_query_options(
        query,
        kinds,
        lambda value, kind, key: convert_option(value, kind, key, valid),
        f"synthetic:{name}",
        valid,
    )
    config = task.config_cls(**{k: v for k, v in options.items() if k in knobs})
    split = canonical_split(split)
    return SyntheticSource(
        name,
        config,
        split,
        seed=options.get("seed", 0),
        num_examples=options.get("n", DEFAULT_SIZES[split]),
        test_fraction=options.get("test_fraction", 0.1),
        distinct=options.get("distinct", False),
        exact_size="n" in options,
    )


def _expand_paths(location: str, split: str, kind: str) -> list[str]:
    pattern = location.replace("{split}", split)
    paths = sorted(glob.glob(os.path.expanduser(pattern)))
    if not paths:
        raise DataError(
            f"{kind} source {location!r} (split {split!r}): no file matches "
            f"{pattern!r}; check the path"
        )
    return paths


def read_jsonl(
    location: str, split: str = "train", fields: FieldNames = FieldNames()
) -> ListSource:
    paths = _expand_paths(location, split, "jsonl")
    rows = (item for path in paths for item in jsonl_rows(path))
    return ListSource(rows_to_records(rows, fields, ", ".join(paths)), location)


def read_parquet(
    location: str, split: str = "train", fields: FieldNames = FieldNames()
) -> ListSource:
    rows = (
        item for path in _expand_paths(location, split, "parquet") for item in parquet_rows(path)
    )
    return ListSource(rows_to_records(rows, fields, location), location)


def read_hub(
    location: str,
    split: str = "train",
    fields: FieldNames = FieldNames(),
    revision: str | None = None,
) -> ListSource:
    """An `hf:OWNER/NAME[:CONFIG][@SPLIT]` source (the text after 'hf:')."""
    spec = HubSpec.parse(location)
    rows, repo = hub_rows(spec, split, revision)
    records = rows_to_records(rows, fields, str(spec))
    return ListSource(records, f"{spec} (revision {repo.commit or repo.revision})")


def _plain(value: Any) -> Any:
    """TFDS numpy / bytes values -> JSON-friendly Python values."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class TfdsSource(Sequence[Record]):
    """A TFDS-prepared dataset through tfds.data_source (random access, no TensorFlow)."""

    def __init__(self, name: str, split: str, fields: FieldNames, data_dir: str | None = None):
        try:
            import tensorflow_datasets as tfds
        except ImportError:
            raise ImportError(
                f"tfds:{name} needs tensorflow-datasets, which is not installed; "
                f"install it with: {TFDS_HINT}"
            ) from None
        self.name = f"tfds:{name}[{split}]"
        self._data = tfds.data_source(name, split=split, data_dir=data_dir)
        if len(self._data) == 0:
            raise DataError(f"{self.name}: the dataset is empty; check the split")
        first, where = _plain(self._data[0]), f"{self.name}:0"
        if not isinstance(first, Mapping):
            raise DataError(f"{where}: expected a dict of features, got {type(first).__name__}")
        self._fields = dataclasses.replace(
            fields,
            prompt_field=pick_field(first, fields.prompt_field, PROMPT_FIELDS, "prompt", where),
            answer_field=pick_field(first, fields.answer_field, ANSWER_FIELDS, "answer", where),
        )

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index):
        row = _plain(self._data[index])
        return rows_to_records([(f"{self.name}:{index}", row)], self._fields, self.name)[0]


def _kind_and_location(spec: str) -> tuple[str, str]:
    head, sep, rest = spec.partition(":")
    if sep and head in SOURCE_KINDS:
        return head, rest
    lowered = spec.lower()
    for suffix, kind in ((".jsonl", "jsonl"), (".parquet", "parquet")):
        if lowered.endswith(suffix):
            return kind, spec
    if spec.isidentifier():
        return "name", spec
    raise DataError(
        f"cannot tell the kind of data source {spec!r}; write one of "
        f"{', '.join(k + ':...' for k in SOURCE_KINDS)}, a path ending in .jsonl "
        f"or .parquet, or a registered name (synthetic tasks: "
        f"{', '.join(sorted(TASKS))})"
    )


def make_source(
    spec: str, split: str = "train", revision: str | None = None, **field_names: Any
) -> Sequence[Record]:
    """A random-access sequence of Records. `field_names`: the FieldNames fields, plus
    data_dir=... for tfds; `revision`: the Hub revision of an hf: source or registered name.
    A registered name or gym: task brings its own fields (field names are not used). See the
    module docstring for the spec syntax."""
    data_dir = field_names.pop("data_dir", None)
    valid = [f.name for f in dataclasses.fields(FieldNames)]
    unknown = sorted(set(field_names) - set(valid))
    if unknown:
        raise DataError(
            f"unknown source option(s) {', '.join(unknown)}; valid: "
            f"{', '.join(valid + ['data_dir'])}"
        )
    fields = FieldNames(**field_names)
    kind, location = _kind_and_location(spec)
    if kind == "name":
        from jaxrl4llm.data.benchmarks import load_benchmark

        return load_benchmark(location, split, revision)
    if kind == "gym":
        from jaxrl4llm.data.gym import parse_gym

        return parse_gym(location, split)
    if kind == "hf":
        return read_hub(location, split, fields, revision)
    if kind == "synthetic":
        return parse_synthetic(location, split)
    if kind == "jsonl":
        return read_jsonl(location, split, fields)
    if kind == "parquet":
        return read_parquet(location, split, fields)
    return TfdsSource(location, split, fields, data_dir=data_dir)
