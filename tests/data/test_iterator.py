"""The batch iterator: deterministic, sharded, epoch-repeating, and exactly resumable."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from jaxrl4llm.data.iterator import make_iterator
from jaxrl4llm.data.records import DataError, Record
from jaxrl4llm.data.rows import ListSource

SOURCE = ListSource([Record(f"q{i}", str(i), {"task": "arithmetic"}) for i in range(23)], "toy")


def _answers(batches):
    return [[r.answer for r in batch] for batch in batches]


def _take(iterator, n):
    return _answers(next(iterator) for _ in range(n))


def test_same_seed_same_order_other_seed_other_order():
    first = _take(make_iterator(SOURCE, 4, seed=7), 10)
    assert first == _take(make_iterator(SOURCE, 4, seed=7), 10)
    assert first != _take(make_iterator(SOURCE, 4, seed=8), 10)
    unshuffled = _take(make_iterator(SOURCE, 5, shuffle=False), 2)
    assert unshuffled == [["0", "1", "2", "3", "4"], ["5", "6", "7", "8", "9"]]


@pytest.mark.parametrize("stop", [0, 1, 5, 6, 13])
def test_resume_yields_exactly_what_would_have_come_next(stop):
    reference = make_iterator(SOURCE, 4, seed=3, shard_index=1, shard_count=2)
    expected = _take(reference, stop + 12)[stop:]
    first = make_iterator(SOURCE, 4, seed=3, shard_index=1, shard_count=2)
    _take(first, stop)
    state = json.loads(json.dumps(first.get_state()))  # it goes through a JSON checkpoint
    resumed = make_iterator(SOURCE, 4, seed=3, shard_index=1, shard_count=2, state=state)
    assert _take(resumed, 12) == expected


def test_epochs_cover_every_record_once_with_a_new_order_each_epoch():
    stream = [a for batch in _take(make_iterator(SOURCE, 23, seed=1), 3) for a in batch]
    epochs = [stream[0:23], stream[23:46], stream[46:69]]
    assert all(sorted(e, key=int) == [str(i) for i in range(23)] for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


def test_hosts_partition_each_epoch():
    # 23 records, 2 hosts x batch 4 = 8 per global step: hosts never overlap within an epoch
    hosts = [
        make_iterator(SOURCE, 4, seed=5, num_epochs=1, shard_index=h, shard_count=2)
        for h in range(2)
    ]
    seen = [a for it in hosts for batch in _answers(it) for a in batch]
    assert Counter(seen) == Counter(str(i) for i in range(23))
    assert [it.num_batches for it in hosts] == [3, 3]


def test_finite_pass_stops_and_drop_remainder():
    assert [len(b) for b in make_iterator(SOURCE, 10, num_epochs=1)] == [10, 10, 3]
    dropped = make_iterator(SOURCE, 10, num_epochs=2, drop_remainder=True)
    assert [len(b) for b in dropped] == [10] * 4


def test_state_is_small_json_and_checked_on_restore():
    iterator = make_iterator(SOURCE, 4, seed=3)
    _take(iterator, 2)
    state = iterator.get_state()
    assert state["next_batch"] == 2 and len(json.dumps(state)) < 300
    assert iterator.epoch == pytest.approx(8 / 23)
    with pytest.raises(ValueError, match="batch_size=4 but this iterator has batch_size=8"):
        make_iterator(SOURCE, 8, seed=3, state=state)
    other = ListSource(SOURCE.records[:10], "smaller")
    with pytest.raises(ValueError, match="num_records"):
        make_iterator(other, 4, seed=3, state=state)


def test_empty_source_and_bad_settings():
    with pytest.raises(DataError, match="empty"):
        make_iterator(ListSource([], "nothing"), 4)
    with pytest.raises(ValueError, match="shard_index"):
        make_iterator(SOURCE, 4, shard_index=2, shard_count=2)
