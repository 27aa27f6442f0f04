"""Prompt data: sources (registered names, hf:, gym:, jsonl, parquet, tfds, synthetic tasks)
-> a resumable batch iterator. docs/data.md has the source strings and the registry.

    source = make_source("synthetic:arithmetic?digits=2&ops=+-", split="train")
    source = make_source("math500", split="test")          # the benchmark registry (Hub)
    it = make_iterator(source, batch_size=8, seed=0, shard_index=0, shard_count=1)
    batch = next(it)                      # list[Record]; Record(prompt, answer, metadata)
    messages = build_messages(batch[0].prompt)
    state = it.get_state()                # JSON-able; make_iterator(..., state=state) resumes
"""

from jaxrl4llm.data.benchmarks import BENCHMARKS, Benchmark, load_benchmark
from jaxrl4llm.data.iterator import BatchIterator, IteratorConfig, make_iterator
from jaxrl4llm.data.prompts import (
    DEFAULT_INSTRUCTION,
    build_messages,
    record_messages,
    user_content,
)
from jaxrl4llm.data.records import DataError, Record
from jaxrl4llm.data.rows import FieldNames, ListSource
from jaxrl4llm.data.sources import (
    SyntheticSource,
    TfdsSource,
    make_source,
    parse_synthetic,
    read_jsonl,
    read_parquet,
)
from jaxrl4llm.data.tasks import TASKS, generate_record, split_of

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "load_benchmark",
    "BatchIterator",
    "IteratorConfig",
    "make_iterator",
    "DEFAULT_INSTRUCTION",
    "build_messages",
    "record_messages",
    "user_content",
    "DataError",
    "Record",
    "FieldNames",
    "ListSource",
    "SyntheticSource",
    "TfdsSource",
    "make_source",
    "parse_synthetic",
    "read_jsonl",
    "read_parquet",
    "TASKS",
    "generate_record",
    "split_of",
]
