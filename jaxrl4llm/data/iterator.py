"""A deterministic, resumable, per-host sharded batch iterator over a record source.

The order is a grain.MapDataset pipeline, a pure function of (source, seed, index):
    source -> shuffle(seed) -> repeat(num_epochs, reseeded each epoch) -> [shard_index::shard_count]
           -> batch(batch_size)
so host h's batch i is computed, not replayed, and the whole state is `next_batch` (plus the
settings, checked on restore). Together, the hosts' i-th batches are consecutive elements of
one global shuffled stream: no record repeats within an epoch across hosts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jaxrl4llm.data.records import DataError, Record

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class IteratorConfig:
    batch_size: int  # records per batch on this host
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None  # None: repeat forever (training); 1: one pass (evaluation)
    shard_index: int = 0  # this host (jax.process_index())
    shard_count: int = 1  # all hosts (jax.process_count())
    drop_remainder: bool = False  # only matters for a finite num_epochs

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(
                f"need 0 <= shard_index < shard_count, got shard_index="
                f"{self.shard_index}, shard_count={self.shard_count}"
            )
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None (forever), got {self.num_epochs}")


class BatchIterator:
    """Yields lists of Records; get_state()/set_state() give a small JSON-able dict."""

    def __init__(self, source: Sequence[Record], config: IteratorConfig):
        import grain  # lazily: keeps `import jaxrl4llm.data` light

        if len(source) == 0:
            raise DataError(f"{getattr(source, 'name', source)!r}: the dataset is empty")
        self.source, self.config = source, config
        ds = grain.MapDataset.source(source)
        if config.shuffle:
            ds = ds.shuffle(seed=config.seed)
        ds = ds.repeat(config.num_epochs)
        ds = ds[config.shard_index :: config.shard_count]
        self._batches = ds.batch(
            config.batch_size, drop_remainder=config.drop_remainder, batch_fn=list
        )
        self._next = 0

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> list[Record]:
        if self.config.num_epochs is not None and self._next >= len(self._batches):
            raise StopIteration
        batch = self._batches[self._next]
        self._next += 1
        return batch

    def peek(self, offset: int = 0) -> list[Record] | None:
        """The batch `offset` batches after the next one, not consumed (None past the end):
        what `next` will give then (the batches are a random-access dataset)."""
        index = self._next + offset
        if self.config.num_epochs is not None and index >= len(self._batches):
            return None
        return self._batches[index]

    def next_batches(self) -> NextBatches:
        """This iterator as dynamic sampling reads it: admission (sampling/admission.py) looks
        at the next batch before it takes it."""
        return NextBatches(self)

    @property
    def num_batches(self) -> int | None:
        """Batches in a finite iteration (num_epochs set), else None."""
        return None if self.config.num_epochs is None else len(self._batches)

    @property
    def epoch(self) -> float:
        """Global epochs consumed so far (all hosts together), e.g. 2.5."""
        seen = self._next * self.config.batch_size * self.config.shard_count
        return seen / len(self.source)

    def get_state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "next_batch": self._next,
            "num_records": len(self.source),
            **dataclasses.asdict(self.config),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Resumes where `state` (from get_state) left off; the settings must match."""
        expected = self.get_state()
        for key in ("version", "num_records", *dataclasses.asdict(self.config)):
            if state.get(key) != expected[key]:
                raise ValueError(
                    f"cannot resume the data iterator: the saved state has {key}="
                    f"{state.get(key)!r} but this iterator has {key}={expected[key]!r}; resume "
                    "with the same data and batch/shard/seed settings, or start a fresh iterator"
                )
        next_batch = int(state["next_batch"])
        if next_batch < 0:
            raise ValueError(f"invalid iterator state: next_batch={next_batch}")
        self._next = next_batch


@dataclasses.dataclass(frozen=True)
class NextBatches:
    """Call: the next batch, consumed; peek(i): the batch i after it, not consumed."""

    iterator: BatchIterator

    def __call__(self) -> list[Record]:
        return next(self.iterator)

    def peek(self, offset: int) -> list[Record] | None:
        return self.iterator.peek(offset)


def make_iterator(
    source: Sequence[Record],
    batch_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
    drop_remainder: bool = False,
    state: dict[str, Any] | None = None,
) -> BatchIterator:
    """A BatchIterator; pass `state` (from get_state, e.g. out of a checkpoint) to resume."""
    iterator = BatchIterator(
        source,
        IteratorConfig(
            batch_size=batch_size,
            seed=seed,
            shuffle=shuffle,
            num_epochs=num_epochs,
            shard_index=shard_index,
            shard_count=shard_count,
            drop_remainder=drop_remainder,
        ),
    )
    if state is not None:
        iterator.set_state(state)
    return iterator
