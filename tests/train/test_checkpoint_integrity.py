"""Checkpoint integrity: damaged checkpoints are detected, the previous one is restored with a
warning naming the bad one, and a clear error names the folder when none is usable.

Each test saves steps 2 and 4 of a small TrainState, damages step 4 the way a crash, a full
disk or a bad disk does, and restores.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl4llm.train.infra import checkpoint, integrity
from jaxrl4llm.train.update import state


def _state(step):
    params = {
        "w": jnp.asarray(np.random.default_rng(step).normal(size=(64, 64)), jnp.float32),
        "b": jnp.full((64,), float(step), jnp.bfloat16),
    }
    return state.TrainState.create(params, optax.adam(1e-2), seed=7).replace(step=jnp.int32(step))


@pytest.fixture
def saved(tmp_path):
    ckpt = checkpoint.Checkpointer(str(tmp_path), every=2, keep=3)
    for step in (2, 4):
        ckpt.save(step, _state(step), {"iterator": {"index": step}})
    ckpt.close()
    return tmp_path


def _largest_file(folder):
    files = [os.path.join(r, f) for r, _, fs in os.walk(folder) for f in fs]
    return max(files, key=os.path.getsize)


def _flip_bytes(path):
    data = bytearray(open_bytes(path))
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    write_bytes(path, bytes(data))


def _truncate(path):
    data = open_bytes(path)
    write_bytes(path, data[: len(data) // 2])


def open_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def write_bytes(path, data):
    with open(path, "wb") as f:
        f.write(data)


DAMAGE = {
    "flipped_bytes": lambda d: _flip_bytes(_largest_file(d / "4" / "state")),
    "truncated_array_file": lambda d: _truncate(_largest_file(d / "4" / "state")),
    "deleted_array_file": lambda d: os.remove(_largest_file(d / "4" / "state")),
    "truncated_metadata": lambda d: _truncate(d / "4" / "state" / "_METADATA"),
    "truncated_data_metadata": lambda d: _truncate(d / "4" / "data" / "metadata"),
    "empty_step_folder": lambda d: os.makedirs(d / "6"),
}


def _restore(directory):
    ckpt = checkpoint.Checkpointer(str(directory), every=2, keep=3)
    try:
        return ckpt.restore(checkpoint.abstract_like(_state(0))), ckpt
    finally:
        ckpt.close()


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(saved, damage, caplog):
    DAMAGE[damage](saved)
    bad, good = ("6", 4) if damage == "empty_step_folder" else ("4", 2)
    (restored, data_state), _ = _restore(saved)
    assert int(restored.step) == good
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(_state(good))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert data_state == {"iterator": {"index": good}}
    assert os.path.join(str(saved), bad) in caplog.text and "falling back" in caplog.text


def test_a_set_aside_bad_step_is_saved_again(saved):
    _flip_bytes(_largest_file(saved / "4" / "state"))
    ckpt = checkpoint.Checkpointer(str(saved), every=2, keep=3)
    restored, _ = ckpt.restore(checkpoint.abstract_like(_state(0)))
    assert int(restored.step) == 2 and ckpt.latest_step() == 2
    ckpt.save(4, _state(4), {"iterator": {"index": 4}})  # not skipped as "already saved"
    assert ckpt.latest_step() == 4
    assert int(ckpt.restore(checkpoint.abstract_like(_state(0)))[0].step) == 4
    ckpt.close()
    assert any(name.startswith("4.corrupt") for name in os.listdir(saved))


def test_no_usable_checkpoint_is_a_clear_error(saved):
    for step in ("2", "4"):
        _flip_bytes(_largest_file(saved / step / "state"))
    with pytest.raises(
        checkpoint.CheckpointError,
        match=rf"No usable checkpoint in {saved}.*step 4: checksum mismatch.*"
        r"step 2: checksum mismatch.*delete",
    ):
        _restore(saved)


def test_a_non_finite_state_is_never_saved(tmp_path):
    ckpt = checkpoint.Checkpointer(str(tmp_path), every=2, keep=3)
    ckpt.save(2, _state(2), {})
    bad = _state(4)
    bad = bad.replace(params=dict(bad.params, w=bad.params["w"].at[3, 5].set(jnp.nan)))
    with pytest.raises(
        checkpoint.NonFiniteStateError,
        match=r"Refusing to save checkpoint 4.*\['w'\].*last good checkpoint is 2",
    ):
        ckpt.save(4, bad, {})
    assert ckpt.latest_step() == 2
    ckpt.close()


def test_a_full_disk_is_a_clear_error_and_leaves_no_partial_step(tmp_path, monkeypatch):
    """What orbax raised when a study filled the disk (ENOSPC in its writer thread, surfaced
    as a ValueError): a CheckpointError naming the folder, the step to resume from and the
    fix; the partial step folder is removed. Any other save error passes through."""
    ckpt = checkpoint.Checkpointer(str(tmp_path), every=2, keep=3)
    ckpt.save(2, _state(2), {})

    def full_disk(step, args):
        os.makedirs(tmp_path / f"{step}.orbax-checkpoint-tmp" / "state")
        raise ValueError(
            'RESOURCE_EXHAUSTED: Error writing "opt_state.1.0.count/0" in OCDBT '
            "database: Failed to write 739627008 bytes to file 12: No space left "
            "on device [os_error_code='28']"
        )

    monkeypatch.setattr(ckpt._manager, "save", full_disk)
    with pytest.raises(
        checkpoint.CheckpointError,
        match=rf"checkpoint 4 to {tmp_path}: no space left.*--keep_checkpoints.*"
        r"resumes from checkpoint 2",
    ):
        ckpt.save(4, _state(4), {})
    assert sorted(os.listdir(tmp_path)) == ["2"]

    def broken(step, args):
        raise ValueError("something else")

    monkeypatch.setattr(ckpt._manager, "save", broken)
    with pytest.raises(ValueError, match="something else"):
        ckpt.save(4, _state(4), {})
    assert ckpt.latest_step() == 2
    ckpt.close()


def test_digests_do_not_depend_on_the_sharding():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    tree = {"w": jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8)}
    sharded = jax.device_put(tree, NamedSharding(mesh, P("x")))
    assert integrity.fingerprint(tree).arrays == integrity.fingerprint(sharded).arrays
    mixed = dict(sharded, step=jax.device_put(jnp.int32(3), jax.devices()[0]))
    assert (
        integrity.fingerprint(mixed).arrays["['w']"] == integrity.fingerprint(tree).arrays["['w']"]
    )
    flipped = {
        "w": tree["w"]
        .at[17, 3]
        .set(
            jax.lax.bitcast_convert_type(
                jax.lax.bitcast_convert_type(tree["w"][17, 3], jnp.uint32) ^ 1, jnp.float32
            )
        )
    }
    assert (
        integrity.fingerprint(flipped).arrays["['w']"]["digest"]
        != integrity.fingerprint(tree).arrays["['w']"]["digest"]
    )
