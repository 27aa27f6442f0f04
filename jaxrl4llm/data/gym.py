"""reasoning-gym procedural tasks as prompt sources: `gym:TASK[?key=value&...]`.

    gym:knights_knaves?n_people=3&depth_constraint=2&width_constraint=2
    gym:countdown?min_numbers=3&max_numbers=4&n=20000
    gym:gsm_symbolic?difficulty=0.5

Every key that is a field of the task's reasoning-gym config is passed to it; ours are `n`
(records per split; default 10,000 train / 500 test), `seed`, `test_fraction` and, for
knights_knaves, `terms`. An integer option may be a range `LO..HI` (one per source): record i
then uses the value LO + i mod (HI - LO + 1), an equal mix, e.g. n_people=3..7 for the
knights-and-knaves training set of Logic-RL / REINFORCE++ (3 to 7 people). Records are
generated on access. The held-out split works as for our synthetic tasks: a puzzle belongs to
"test" iff its question hashes into the `test_fraction` bucket, so train and test never share
a question (reasoning-gym alone only offers different seeds). Scoring is reasoning-gym's own
`score_answer` (rewards/gym.py), run in the verifier pool.

knights_knaves: reasoning-gym draws the role words of each puzzle from seven pairs
(knight/knave, hero/villain, saint/sinner, ...), which is Xie et al.'s "random_pair"
perturbation; the clean data of Xie et al. (arXiv:2410.23123) that Logic-RL and REINFORCE++
train on says knight/knave. `terms=knight` (the default) rewrites a puzzle's pair to
knight/knave in the question and the reference; `terms=random` keeps reasoning-gym's.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import typing
from typing import Any, Sequence

from jaxrl4llm.config.errors import DependencyError
from jaxrl4llm.data.records import DataError, Record
from jaxrl4llm.data.rows import convert_option, parse_query_options
from jaxrl4llm.data.tasks.common import canonical_split, split_of

GYM_HINT = "pip install -e '.[gym]' (the reasoning-gym package)"
OUR_OPTIONS = {"n": int, "seed": int, "test_fraction": float, "terms": str}
DEFAULT_SIZES = {"train": 10_000, "test": 500}
TERMS = ("knight", "random")
ATTEMPTS = 256  # draws per record until its question hashes into the split (0.9**256 ~ 2e-12)
# reasoning-gym's questions carry their own answer format; the answer goes in tags.
INSTRUCTION = "Put your final answer within <answer> </answer> tags."


def import_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise DependencyError(
            f"gym: sources need reasoning-gym, which is not installed; install it with: {GYM_HINT}"
        ) from None
    return reasoning_gym


def _field_kind(default: Any, hint: Any) -> Any:
    """The Python type a query value converts to, from the config field."""
    base = hint
    if typing.get_origin(hint) is typing.Union or type(hint).__name__ == "UnionType":
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if args else str
    if base in (bool, int, float, str):
        return base
    if isinstance(default, (tuple, list)) or typing.get_origin(base) in (tuple, list):
        items = typing.get_args(base)
        return ("list", items[0] if items and items[0] is not Ellipsis else str)
    return str


def _convert(text: str, kind: Any, key: str, where: str) -> Any:
    """A query value as the config field's type; a list field takes comma-separated items,
    an int field a range LO..HI."""
    if kind is int and ".." in text:
        low, _, high = text.partition("..")
        low, high = (convert_option(v, int, key, f"see {where}") for v in (low, high))
        if low > high:
            raise DataError(f"{where}: range {key}={text} is empty; write LO..HI with LO <= HI")
        return range(low, high + 1)
    if isinstance(kind, tuple):
        return tuple(_convert(part, kind[1], key, where) for part in text.split(",") if part)
    return convert_option(text, kind, key, f"see {where}'s reasoning-gym config")


def _config_kinds(config_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(config_cls)
    kinds = {}
    for f in dataclasses.fields(config_cls):
        if f.name in ("seed", "size"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        kinds[f.name] = _field_kind(default, hints.get(f.name, str))
    return kinds


def _plain_terms(entry: dict[str, Any]) -> dict[str, Any]:
    """A knights_knaves entry with its role pair rewritten to knight / knave."""
    terms = entry["metadata"].get("knight_knave_terms") or {}
    knight, knave = str(terms.get("knight", "knight")), str(terms.get("knave", "knave"))
    if (knight, knave) == ("knight", "knave"):
        return entry
    swaps = [
        (str(terms["a_knight"]), "a knight"),
        (str(terms["a_knave"]), "a knave"),
        (knight.capitalize(), "Knight"),
        (knave.capitalize(), "Knave"),
        (knight, "knight"),
        (knave, "knave"),
    ]

    def rewrite(text: str) -> str:
        for old, new in swaps:  # whole words; a plural "s" may follow
            text = re.sub(rf"\b{re.escape(old)}(?=s?\b)", new, text)
        return text

    metadata = dict(
        entry["metadata"],
        knight_knave_terms={
            "knight": "knight",
            "knave": "knave",
            "a_knight": "a knight",
            "a_knave": "a knave",
            "Knight": "Knight",
            "Knave": "Knave",
        },
    )
    return dict(
        entry,
        question=rewrite(entry["question"]),
        answer=rewrite(entry["answer"]),
        metadata=metadata,
    )


class GymSource(Sequence[Record]):
    """`num_examples` records of a reasoning-gym task's split, each generated on access."""

    def __init__(
        self,
        task: str,
        options: dict[str, Any],
        split: str,
        *,
        seed: int = 0,
        num_examples: int | None = None,
        test_fraction: float = 0.1,
        terms: str = "knight",
    ):
        gym = import_gym()
        from reasoning_gym.factory import DATASETS

        where = f"gym:{task}"
        if task not in DATASETS:
            raise DataError(
                f"{where}: reasoning-gym has no task {task!r}; it has {', '.join(sorted(DATASETS))}"
            )
        if terms not in TERMS:
            raise DataError(f"{where}: terms must be one of {', '.join(TERMS)}, got {terms!r}")
        self.split = canonical_split(split)
        self.num_examples = DEFAULT_SIZES[self.split] if num_examples is None else num_examples
        if self.num_examples < 1 or not 0.0 < test_fraction < 1.0:
            raise DataError(
                f"{where}: need n >= 1 and 0 < test_fraction < 1, got "
                f"n={self.num_examples}, test_fraction={test_fraction}"
            )
        self.task, self.options, self.seed = task, dict(options), seed
        self.test_fraction, self.terms = test_fraction, terms
        ranged = [k for k, v in self.options.items() if isinstance(v, range)]
        if len(ranged) > 1:
            raise DataError(
                f"{where}: only one option may be a range LO..HI, got {', '.join(ranged)}"
            )
        values = list(self.options[ranged[0]]) if ranged else [None]
        self.config_jsons, self._datasets = [], []
        for value in values:  # one reasoning-gym dataset per value of the ranged option
            config = {
                **self.options,
                **({ranged[0]: value} if ranged else {}),
                "seed": seed,
                "size": self.num_examples * ATTEMPTS,
            }
            self.config_jsons.append(json.dumps(config, sort_keys=True))
            try:
                self._datasets.append(gym.create_dataset(task, **config))
            except (AssertionError, TypeError, ValueError) as exc:
                raise DataError(
                    f"{where}: reasoning-gym refused the options {config}: "
                    f"{exc or type(exc).__name__}"
                ) from None
        self.name = f"{where}/{self.split}"

    def __len__(self) -> int:
        return self.num_examples

    def entry(self, index: int) -> dict[str, Any]:
        """The reasoning-gym entry of record `index`: the first of its ATTEMPTS draws whose
        question hashes into this split."""
        if not -self.num_examples <= index < self.num_examples:
            raise IndexError(index)
        index %= self.num_examples
        dataset = self._datasets[index % len(self._datasets)]
        local = index // len(self._datasets)
        for attempt in range(ATTEMPTS):
            entry = dataset[local * ATTEMPTS + attempt]
            if self.task == "knights_knaves" and self.terms == "knight":
                entry = _plain_terms(entry)
            if split_of(f"gym:{self.task}", entry["question"], self.test_fraction) == self.split:
                return entry
        raise DataError(
            f"{self.name}: no {self.split} puzzle in {ATTEMPTS} draws with "
            f"{self.options}; the task's problem space is too small for "
            f"test_fraction={self.test_fraction}"
        )

    def __getitem__(self, index):
        entry = self.entry(index)
        config_json = self.config_jsons[index % self.num_examples % len(self._datasets)]
        metadata = {
            "task": "gym",
            "gym_task": self.task,
            "gym_config": config_json,
            "gym_entry": pickle.dumps(entry),
            "instruction": INSTRUCTION,
            "split": self.split,
            "id": f"gym:{self.task}/{self.split}/{self.seed}/{index % self.num_examples}",
            **{
                k: v for k, v in entry["metadata"].items() if isinstance(v, (str, int, float, bool))
            },
        }
        return Record(prompt=entry["question"], answer=str(entry["answer"]), metadata=metadata)

    def __repr__(self) -> str:
        return f"GymSource({self.name!r}, {self.options}, seed={self.seed}, n={len(self)})"


def parse_gym(body: str, split: str) -> GymSource:
    """'knights_knaves?n_people=3&depth_constraint=2' -> GymSource."""
    task, _, query = body.partition("?")
    where = f"gym:{task}"
    import_gym()
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise DataError(
            f"{where}: reasoning-gym has no task {task!r}; it has {', '.join(sorted(DATASETS))}"
        )
    kinds = {**_config_kinds(DATASETS[task][1]), **OUR_OPTIONS}
    values = parse_query_options(
        query,
        kinds,
        lambda text, kind, key: _convert(text, kind, key, where),
        where,
        ", ".join(sorted(kinds)),
    )
    ours = {k: values.pop(k) for k in list(values) if k in OUR_OPTIONS}
    return GymSource(
        task,
        values,
        split,
        seed=ours.get("seed", 0),
        num_examples=ours.get("n"),
        test_fraction=ours.get("test_fraction", 0.1),
        terms=ours.get("terms", "knight"),
    )
