"""The seeds' datasets by short name: each entry is a few lines of data, not code.

    --data=gsm8k            --eval_data=math500            --eval_sets=math500,aime24

An entry says where the data lives on the Hugging Face Hub (an `hf:` source, read by
data/hub.py), which column is the question and which the reference answer, how that answer
is normalised (one of ANSWER_FORMS), the evaluation protocol the papers report (the default
options of an `--eval_sets` item) and its size. docs/data.md lists them with their sources.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator, Mapping

from absl import logging

from jaxrl4llm.data.code_sets import ROW_FORMS
from jaxrl4llm.data.hub import HubSpec, hub_rows
from jaxrl4llm.data.records import DataError
from jaxrl4llm.data.rows import FieldNames, ListSource, rows_to_records
from jaxrl4llm.rewards import extract


def _text(value: Any) -> str | None:
    text = str(value).strip() if value is not None else ""
    return text or None


def _after_hashes(value: Any) -> str | None:
    """GSM8K: the reference is the solution's text after its last '####' ('1,000' -> '1000')."""
    text = str(value or "")
    if "####" not in text:
        return None
    return _text(text.rsplit("####", 1)[1].replace(",", ""))


def _last_boxed(value: Any) -> str | None:
    """A worked solution: its last \\boxed{...} (None when it has no box)."""
    return _text(extract.extract_boxed(str(value or "")))


def _boxed_or_text(value: Any) -> str | None:
    """An answer column that holds either the answer or a solution with a box."""
    text = str(value or "")
    return _last_boxed(text) if "\\boxed" in text or "\\fbox" in text else _text(text)


def _answer_list(value: Any) -> str | None:
    """OlympiadBench's final_answer: a list of LaTeX strings ('$x=1$') -> 'x=1, y=2'."""
    items = value if isinstance(value, (list, tuple)) else [value]
    parts = [str(item).strip().strip("$").strip() for item in items if item is not None]
    return _text(", ".join(p for p in parts if p))


ANSWER_FORMS: dict[str, Callable[[Any], str | None]] = {
    "text": _text,
    "gsm8k": _after_hashes,
    "boxed": _last_boxed,
    "boxed_or_text": _boxed_or_text,
    "list": _answer_list,
}


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    source: str  # hf:OWNER/NAME[:CONFIG]
    splits: Mapping[str, str]  # the run's split ("train" / "test") -> the Hub split
    prompt_field: str
    answer_field: str
    answer: str  # an ANSWER_FORMS name
    protocol: str  # default --eval_sets options (";"-separated)
    metric: str  # what the papers report
    size: str  # rows per Hub split
    drop_unanswerable: bool = False  # drop (and count) rows whose answer does not normalise
    task: str = "math"
    # A selection of the rows, applied in this order: only rows whose column holds one of the
    # values (column -> values), then the `shortest` rows by prompt length in characters, ties
    # in the published row order (so the selection is the same on every machine and tokenizer).
    where: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    shortest: int | None = None

    row_form: str | None = None  # a code_sets.ROW_FORMS name: the row -> question, tests
    licence: str = ""


# Sources: the repositories verl / Minimal-RL / lighteval / Qwen2.5-Math evaluation read.
# A benchmark has one split; --data=aime24 trains on it (REINFORCE++ 4.2.1 does).
BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "math500",
            "hf:HuggingFaceH4/MATH-500",
            {"train": "test", "test": "test"},
            "problem",
            "answer",
            "text",
            "avg@16;t=1.0",
            "Minimalist: avg@16 at T=1.0; REINFORCE++: pass@1",
            "test 500",
        ),
        Benchmark(
            "aime24",
            "hf:HuggingFaceH4/aime_2024",
            {"train": "train", "test": "train"},
            "problem",
            "answer",
            "text",
            "pass@8;avg@8;t=1.0",
            "REINFORCE++: pass@8",
            "train 30",
        ),
        Benchmark(
            "aime25",
            "hf:MathArena/aime_2025",
            {"train": "train", "test": "train"},
            "problem",
            "answer",
            "text",
            "pass@8;avg@8;t=1.0",
            "REINFORCE++ 4.2.1 (train on AIME-24, test on AIME-25)",
            "train 30",
        ),
        Benchmark(
            "amc23",
            "hf:knoveleng/AMC-23",
            {"train": "train", "test": "train"},
            "problem",
            "answer",
            "text",
            "pass@8;avg@8;t=1.0",
            "REINFORCE++: pass@8",
            "train 40",
        ),
        Benchmark(
            "minerva_math",
            "hf:math-ai/minervamath",
            {"train": "test", "test": "test"},
            "question",
            "answer",
            "text",
            "avg@16;t=1.0",
            "Minimalist: avg@16 at T=1.0",
            "test 272",
        ),
        Benchmark(
            "olympiadbench",
            "hf:Hothan/OlympiadBench:OE_TO_maths_en_COMP",
            {"train": "train", "test": "train"},
            "question",
            "final_answer",
            "list",
            "avg@16;t=1.0",
            "Minimalist: avg@16 at T=1.0 (open-ended, text-only, English maths)",
            "train 675",
        ),
        Benchmark(
            "gsm8k",
            "hf:openai/gsm8k:main",
            {"train": "train", "test": "test"},
            "question",
            "answer",
            "gsm8k",
            "greedy",
            "accuracy (greedy)",
            "train 7,473 / test 1,319",
        ),
        # Training sets.
        Benchmark(
            "numina_math",
            "hf:ScaleML-RLHF/numina_math",
            {"train": "train"},
            "problem",
            "answer",
            "boxed_or_text",
            "greedy",
            "Minimalist's training prompts (scripts/data_preprocess/numina_math.py)",
            "train (size as published)",
            drop_unanswerable=True,
        ),
        Benchmark(
            "dapo_math_17k",
            "hf:open-r1/DAPO-Math-17k-Processed:all",
            {"train": "train"},
            "prompt",
            "solution",
            "text",
            "greedy",
            "DAPO's training prompts, de-duplicated (open-r1)",
            "train 17,398",
        ),
        # REINFORCE++ (arXiv 2501.03262v3) §4.2.3, "Dataset": MATH's training problems of
        # levels 3-5, about 8,000 of the shortest prompts. The 12k training split (MATH train + the
        # test problems outside MATH-500, as PRM800K splits it) holds about 8,800 such rows; 8,000
        # and the character length are this project's reading of "about 8,000 short prompts".
        Benchmark(
            "math_lvl3to5_8k",
            "hf:nlile/hendrycks-MATH-benchmark",
            {"train": "train"},
            "problem",
            "answer",
            "text",
            "greedy",
            "REINFORCE++ zero-RL training prompts (MATH levels 3-5, the 8,000 shortest)",
            "train 8,000 of 12,000",
            where={"level": (3, 4, 5)},
            shortest=8000,
        ),
    )
}

# Code sets (task "code": the verifier runs the record's tests in the sandbox; data/code_sets.py
# turns each set's test columns into them). Offline, they load from the hub cache like the rest.
BENCHMARKS.update(
    {
        b.name: b
        for b in (
            Benchmark(
                "humaneval",
                "hf:openai/openai_humaneval",
                {"train": "test", "test": "test"},
                "question",
                "code_answer",
                "text",
                "greedy",
                "Codex paper: pass@1 (greedy here) and pass@k",
                "test 164",
                task="code",
                row_form="humaneval",
                licence="MIT",
            ),
            Benchmark(
                "mbpp",
                "hf:google-research-datasets/mbpp:full",
                {"train": "train", "test": "test"},
                "question",
                "code_answer",
                "text",
                "greedy",
                "MBPP paper: tasks solved (3 assert tests each)",
                "train 374 / test 500",
                drop_unanswerable=True,
                task="code",
                row_form="mbpp",
                licence="CC-BY-4.0",
            ),
            Benchmark(
                "apps",
                "hf:codeparrot/apps",
                {"train": "train", "test": "test"},
                "question",
                "code_answer",
                "text",
                "greedy",
                "APPS paper: strict accuracy (all tests pass), stdin/stdout problems only",
                "train 5,000 / test 5,000 (call-based problems dropped)",
                drop_unanswerable=True,
                task="code",
                row_form="apps",
                licence="MIT",
            ),
        )
    }
)


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise DataError(
            f"unknown dataset name {name!r}; registered: "
            f"{', '.join(sorted(BENCHMARKS))} (or write a source: hf:OWNER/NAME, "
            "gym:TASK, synthetic:TASK, jsonl:PATH, parquet:PATH)"
        )
    return BENCHMARKS[name]


def normalized_rows(
    bench: Benchmark, rows: Iterable[tuple[str, Any]], counts: dict[str, int]
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Rows with the reference answer normalised into "answer" (the original column stays
    in metadata); rows without one are dropped and counted (drop_unanswerable) or refused."""
    form = ANSWER_FORMS[bench.answer]
    for where, row in rows:
        counts["rows"] += 1
        if bench.row_form is not None and isinstance(row, Mapping):
            row = ROW_FORMS[bench.row_form](row)
            if row is None:  # no test the verifier can run
                if bench.drop_unanswerable:
                    counts["dropped"] += 1
                    continue
                raise DataError(f"{where}: {bench.name}: the row has no usable tests")
        if not isinstance(row, Mapping) or bench.prompt_field not in row:
            found = ", ".join(sorted(row)) if isinstance(row, Mapping) else type(row).__name__
            raise DataError(
                f"{where}: {bench.name} expects a {bench.prompt_field!r} column; "
                f"the row has {found}"
            )
        answer = form(row.get(bench.answer_field))
        if answer is None:
            if bench.drop_unanswerable:
                counts["dropped"] += 1
                continue
            raise DataError(
                f"{where}: {bench.name}: no reference answer in column "
                f"{bench.answer_field!r} ({bench.answer} form): "
                f"{str(row.get(bench.answer_field))[:200]!r}"
            )
        yield where, {**row, "reference_answer": answer, "benchmark": bench.name}


def selected_rows(bench: Benchmark, rows: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    """The entry's selection (`where`, then `shortest`) of (location, row) pairs."""
    rows = (
        item
        for item in rows
        if all(item[1].get(column) in values for column, values in bench.where.items())
    )
    if bench.shortest is None:
        return rows
    kept = list(rows)
    length = [len(str(row.get(bench.prompt_field, ""))) for _, row in kept]
    order = sorted(range(len(kept)), key=lambda i: (length[i], i))
    chosen = set(order[: bench.shortest])
    return [item for i, item in enumerate(kept) if i in chosen]


def load_benchmark(name: str, split: str = "test", revision: str | None = None) -> ListSource:
    """The records of a registered dataset's split (a ListSource), answers normalised."""

    bench = get_benchmark(name)
    if split not in bench.splits:
        raise DataError(
            f"{name} has no {split!r} split (it has {', '.join(bench.splits)}); "
            f"it is a training set: evaluate on another (--eval_data / --eval_sets)"
        )
    spec = HubSpec.parse(bench.source[len("hf:") :])
    spec = dataclasses.replace(spec, split=bench.splits[split])
    rows, repo = hub_rows(spec, split, revision)
    counts = {"rows": 0, "dropped": 0}
    fields = FieldNames(
        prompt_field=bench.prompt_field, answer_field="reference_answer", task=bench.task
    )
    records = rows_to_records(
        normalized_rows(bench, selected_rows(bench, rows), counts), fields, f"{name} ({spec})"
    )
    if counts["dropped"]:
        logging.warning(
            "%s: dropped %d of %d rows without an extractable answer in %r.",
            name,
            counts["dropped"],
            counts["rows"],
            bench.answer_field,
        )
    source = ListSource(records, f"{name}@{repo.commit or repo.revision}")
    source.counts = dict(counts, kept=len(records))
    return source
