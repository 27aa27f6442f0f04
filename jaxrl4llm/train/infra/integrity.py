"""Checkpoint integrity: per-array digests and finiteness, computed on device.

A digest is sum_i bits(x_i) * w(i) mod 2^32 over the array's elements, with w(i) an odd hash of
the element's global index. Integer addition mod 2^32 is exact in any order, so the digest
does not depend on the sharding or the number of hosts, is computed where the shards live
(one jitted pass, no gather onto a host), and changes with any single flipped bit.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.config import paths

RECORD_NAME = "integrity.json"
FORMAT = 1


def _bits_u32(x: jax.Array) -> jax.Array:
    """The element bits as uint32 (64-bit elements gain a trailing axis of two words)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)


def _index_weights(
    shape: tuple[int, ...], global_shape: tuple[int, ...], offsets: jax.Array
) -> jax.Array:
    """An odd pseudo-random uint32 weight per element of a block of `shape` starting at
    `offsets` in an array of `global_shape`, from the element's row-major global index."""
    index = jnp.zeros(shape, jnp.uint32)
    for axis, size in enumerate(global_shape):
        position = jax.lax.broadcasted_iota(jnp.uint32, shape, axis) + offsets[axis]
        index = index * jnp.uint32(size) + position
    h = index ^ (index >> 16)  # murmur3's finalizer: nearby indices get unrelated weights
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    return h | jnp.uint32(1)


@functools.partial(jax.jit, static_argnames=("global_shape",))
def _block_check(
    block: jax.Array, offsets: jax.Array, *, global_shape: tuple[int, ...]
) -> tuple[jax.Array, jax.Array]:
    """(digest, all finite) of one block of an array (a shard on one device)."""
    bits = _bits_u32(block)
    extra = bits.shape[len(global_shape) :]  # 64-bit elements: two words each
    digest = jnp.sum(
        bits
        * _index_weights(
            bits.shape,
            tuple(global_shape) + extra,
            jnp.concatenate([offsets, jnp.zeros(len(extra), jnp.uint32)]),
        ),
        dtype=jnp.uint32,
    )
    if jnp.issubdtype(block.dtype, jnp.inexact):
        return digest, jnp.isfinite(block).all()
    return digest, jnp.array(True)


def _shard_offsets(index: tuple[slice, ...], ndim: int) -> np.ndarray:
    return np.array([s.start or 0 for s in index] + [0] * (ndim - len(index)), np.uint32)


class Fingerprint(NamedTuple):
    arrays: dict[str, dict[str, Any]]  # leaf path -> {"digest", "shape", "dtype"}
    nonfinite: list[str]  # leaf paths holding NaN or inf


def fingerprint(tree: Any) -> Fingerprint:
    """Digests and finiteness of every array leaf of `tree`.

    Each device digests the shards it holds (one replica of each), with no collective: on
    the CPU backend, collectives in programs dispatched while other threads (orbax's) run
    programs can deadlock. Partial digests add up mod 2^32 on the host (and over hosts)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    pending = []  # per leaf: [(digest, finite)] of its local shards, still on device
    for _, leaf in leaves:
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        shards = [s for s in getattr(leaf, "addressable_shards", ()) if s.replica_id == 0]
        if not shards:  # a host value (numpy / scalar)
            leaf = jnp.asarray(leaf)
            shards = [s for s in leaf.addressable_shards if s.replica_id == 0]
        pending.append(
            [
                _block_check(
                    s.data, _shard_offsets(s.index, leaf.ndim), global_shape=tuple(leaf.shape)
                )
                for s in shards
            ]
        )
    local = jax.device_get(pending)
    digests = np.array([sum(int(d) for d, _ in parts) % 2**32 for parts in local], np.uint32)
    finite = np.array([all(bool(f) for _, f in parts) for parts in local], bool)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        all_digests, all_finite = multihost_utils.process_allgather((digests, finite))
        digests = np.asarray(all_digests, np.uint64).sum(axis=0) % 2**32  # uint32 per host
        finite = np.all(np.asarray(all_finite), axis=0)
    arrays, nonfinite = {}, []
    for (path, leaf), digest, ok in zip(leaves, digests, finite):
        name = jax.tree_util.keystr(path)
        arrays[name] = {
            "digest": int(digest),
            "shape": list(np.shape(leaf)),
            "dtype": str(leaf.dtype),
        }
        if not ok:
            nonfinite.append(name)
    return Fingerprint(arrays, nonfinite)


def data_digest(data_state: Any) -> str:
    return hashlib.sha256(json.dumps(data_state, sort_keys=True).encode()).hexdigest()


def write_record(directory: str, step: int, saved: Fingerprint, data_state: Any) -> None:
    """Writes the record atomically (aside, then renamed) into the step's folder."""
    record = {
        "format": FORMAT,
        "step": int(step),
        "arrays": saved.arrays,
        "data_sha256": data_digest(data_state),
    }
    paths.write_text(paths.join(directory, RECORD_NAME), json.dumps(record))


def read_record(directory: str) -> dict[str, Any] | None:
    """The step's record; None when it has none (saved before records existed). A record
    that does not parse raises ValueError."""
    path = paths.join(directory, RECORD_NAME)
    if not paths.exists(path):
        return None
    record = json.loads(paths.read_text(path))
    if not isinstance(record, dict) or not isinstance(record.get("arrays"), dict):
        raise ValueError(f"{path} is not an integrity record")
    return record


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def problems(record: dict[str, Any] | None, restored: Fingerprint, data_state: Any) -> list[str]:
    """What is wrong with a restored checkpoint: non-finite arrays, and (with a record) arrays
    or data whose digest differs from the one taken at save time."""
    found = []
    if restored.nonfinite:
        found.append(
            f"non-finite values in {_plural(len(restored.nonfinite), 'array')} "
            f"({', '.join(restored.nonfinite[:3])})"
        )
    if record is None:
        return found
    saved = record["arrays"]
    changed = [
        name
        for name, entry in restored.arrays.items()
        if name not in saved or saved[name]["digest"] != entry["digest"]
    ]
    missing = sorted(set(saved) - set(restored.arrays))
    if changed:
        found.append(
            f"checksum mismatch in {_plural(len(changed), 'array')} "
            f"({', '.join(changed[:3])}): the files changed after they were saved"
        )
    if missing:
        found.append(
            f"{_plural(len(missing), 'saved array')} not restored ({', '.join(missing[:3])})"
        )
    if record.get("data_sha256") != data_digest(data_state):
        found.append("checksum mismatch in the data-iterator state")
    return found
