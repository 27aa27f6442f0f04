"""Mesh construction and logical sharding rules on the 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl4llm import parallel


def test_eight_fake_devices_are_available():
    assert jax.device_count() == 8


@pytest.mark.parametrize(
    "text,expected",
    [
        ("data=1,fsdp=4,tensor=2", (1, 4, 1, 2)),
        ("data:2,fsdp:-1,tensor:1", (2, 4, 1, 1)),
        ("fsdp:-1", (1, 8, 1, 1)),
        ("data:1,fsdp:1,tensor:-1", (1, 1, 1, 8)),
        ("fsdp:2,expert:-1", (1, 2, 4, 1)),
        ("expert:2,tensor:2,fsdp:-1", (1, 2, 2, 2)),
    ],
)
def test_mesh_from_spec(text, expected):
    mesh = parallel.make_mesh(text)
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert tuple(mesh.shape.values()) == expected
    assert mesh.devices.size == 8


@pytest.mark.parametrize(
    "text,message",
    [
        ("data=1,fsdp=3,tensor=2", "needs 6 devices but 8 are available"),
        ("data=3,fsdp=-1", "does not divide the 8 available devices"),
        ("data=-1,fsdp=-1", "more than one axis of size -1"),
        ("pipeline=2", "AXIS one of data, fsdp, expert, tensor"),
        ("expert=3,fsdp=-1", "does not divide the 8 available devices"),
        ("data=two", "is not an integer"),
        ("data=0", "0 or below -1"),
    ],
)
def test_bad_mesh_spec_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match=message):
        parallel.make_mesh(text)


def test_mesh_over_a_subset_of_devices():
    mesh = parallel.make_mesh("data:1,fsdp:2,tensor:1", devices=jax.devices()[:2])
    assert mesh.devices.size == 2


def test_logical_rules_map_to_partition_specs():
    assert parallel.logical_to_partition_spec(("batch", "length")) == P(
        ("data", "fsdp", "expert"), None
    )
    # A mixture of experts' expert weights: experts over expert, width over fsdp, MLP tensor.
    assert parallel.logical_to_partition_spec(("experts", "embed", "mlp")) == P(
        "expert", "fsdp", "tensor"
    )
    assert parallel.logical_to_partition_spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert parallel.logical_to_partition_spec(("layers", "embed", "heads", "head_dim")) == P(
        None, "fsdp", "tensor", None
    )
    # A mesh axis is used once per array: the second "tensor" request is dropped.
    assert parallel.logical_to_partition_spec(("heads", "mlp")) == P("tensor", None)
    with pytest.raises(KeyError, match="no sharding rule"):
        parallel.logical_to_partition_spec(("nonsense",))


def test_indivisible_dims_are_replicated():
    mesh = parallel.make_mesh("data:1,fsdp:4,tensor:2")
    # 3 KV heads cannot be split over tensor=2; 8 embed can be split over fsdp=4.
    spec = parallel.logical_to_partition_spec(("embed", "kv_heads"), shape=(8, 3), mesh=mesh)
    assert spec == P("fsdp", None)


def test_sharded_pytree_keeps_values_and_layout():
    mesh = parallel.make_mesh("data:1,fsdp:4,tensor:2")
    tree = {"w": jnp.arange(64.0).reshape(8, 8), "b": jnp.arange(8.0)}
    axes = {"w": ("embed", "mlp"), "b": ("mlp",)}
    sharded = parallel.shard_pytree(tree, axes, mesh)
    np.testing.assert_array_equal(sharded["w"], tree["w"])
    assert sharded["w"].sharding.spec == P("fsdp", "tensor")
    assert sharded["w"].addressable_shards[0].data.shape == (2, 4)
    assert sharded["b"].sharding.spec == P("tensor")


def test_batch_sharding_splits_rows_over_the_data_parallel_axes():
    mesh = parallel.make_mesh("data:2,fsdp:2,tensor:2")
    x = jax.device_put(jnp.zeros((8, 5)), parallel.batch_sharding(mesh, 2))
    assert x.addressable_shards[0].data.shape == (2, 5)


def test_single_process_does_not_start_distributed(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert parallel.maybe_initialize_distributed() is False


def test_strided_slices_span_every_device_and_merge_back():
    x = jnp.arange(16 * 3).reshape(16, 3)
    # 4 slices of whole groups of 2 rows: slice k holds groups k, k + 4 (rows 2k, 2k+1, ...).
    s = parallel.split_strided(x, 4, group=2)
    assert s.shape == (4, 4, 3)
    np.testing.assert_array_equal(s[1, :, 0], np.array([2, 3, 10, 11]) * 3)
    np.testing.assert_array_equal(parallel.merge_strided(s, group=2), x)
    np.testing.assert_array_equal(parallel.split_strided(x, 4)[1, :, 0], [3, 15, 27, 39])
    with pytest.raises(ValueError, match="whole groups of 4"):
        parallel.split_strided(x, 8, group=4)
    # On 8 devices holding 2 rows each, every slice of 4 strided rows lands on 4 devices.
    mesh = parallel.make_mesh("data:1,fsdp:8,tensor:1")
    rows = jax.device_put(jnp.arange(16), parallel.batch_sharding(mesh, 1))
    owner = {
        int(i): d
        for s in rows.addressable_shards
        for i, d in zip(np.asarray(s.data), [s.device] * 2)
    }
    for k in range(4):
        assert len({owner[int(r)] for r in parallel.split_strided(jnp.arange(16), 4)[k]}) == 4


def test_row_chunks_keep_whole_groups():
    assert parallel.num_row_chunks(64, 0) == 1 and parallel.num_row_chunks(64, 64) == 1
    assert parallel.num_row_chunks(64, 16) == 4
    assert parallel.num_row_chunks(48, 20, group=4) == 3  # 16 rows: whole groups
    assert parallel.num_row_chunks(24, 10, group=4) == 3


def test_activation_sharding_constrains_and_counts_shards():
    mesh = parallel.make_mesh("data:2,fsdp:2,tensor:2")
    sharding = parallel.ActivationSharding(mesh)
    assert sharding.shards("batch", 8) == 4 and sharding.shards("batch", 6) == 1
    assert sharding.shards("vocab", 10) == 2 and sharding.shards("length", 8) == 1
    f = jax.jit(lambda x: sharding.constrain(x * 2, ("batch", None, "heads")))
    y = f(jnp.ones((8, 3, 4)))
    # (A compiled program's output names no axis of size 1: here the expert axis.)
    assert y.sharding.spec == P(("data", "fsdp"), None, "tensor")
    assert parallel.constrain(y, ("batch",), None) is y


def test_a_mesh_without_an_axis_drops_it_from_the_rules():
    """A mesh made without the expert axis (jax.make_mesh by hand) still takes the rules."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert parallel.batch_sharding(mesh, 2).spec == P(("data", "fsdp"), None)
    assert parallel.logical_to_partition_spec(("experts", "mlp"), mesh=mesh) == P(None, None)
    assert parallel.data_parallel_size(mesh) == 8


def test_without_batch_axes_takes_the_batchs_mesh_axes_out_of_the_weights():
    rules = dict(parallel.without_batch_axes())
    assert rules["batch"] == ("data", "fsdp", "expert") and rules["embed"] is None
    assert rules["vocab"] == rules["mlp"] == rules["heads"] == "tensor"
    # The experts stay split: their tokens go to them (models/moe.py).
    assert rules["experts"] == "expert"
    # Weights over fsdp and tensor, a batch over data only: fsdp stays, tensor too.
    custom = (("batch", "data"), ("embed", ("fsdp", "data")), ("mlp", "tensor"), ("norm", None))
    assert parallel.without_batch_axes(custom) == (
        ("batch", "data"),
        ("embed", "fsdp"),
        ("mlp", "tensor"),
        ("norm", None),
    )


def test_traces_inside_lowering_for_choose_as_on_that_platform():
    """parallel.backend() is the process's backend, or the one lowering_for names; a program
    jitted and traced before is traced again inside it (and after it), not reused from the
    other platform's trace; an unknown platform is refused."""
    choice = jax.jit(lambda: jnp.int32({"cpu": 0, "gpu": 1, "tpu": 2}[parallel.backend()]))
    assert parallel.backend() == jax.default_backend() == "cpu"
    assert int(choice()) == 0
    with parallel.lowering_for("tpu"):
        assert parallel.backend() == "tpu" and int(choice()) == 2
    assert parallel.backend() == "cpu" and int(choice()) == 0
    with pytest.raises(ValueError, match="choose one of"):
        with parallel.lowering_for("cuda"):
            pass


def test_no_module_but_backend_py_asks_jax_for_the_backend():
    """Trace-time choices by platform read parallel.backend() (docs/architecture.md,
    "Invariants"): a jax.default_backend() call elsewhere in the package would make a
    program exported for a TPU differ from the one a TPU runs."""
    import pathlib

    package = pathlib.Path(parallel.__file__).parents[1]
    callers = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if "default_backend()" in path.read_text() and path.name != "backend.py"
    ]
    assert callers == []
