"""Reading compiled programs: collectives with their loop trip counts, reduce-scatters made of
all-reduce + slice, bfloat16 values counted at their width, matmul FLOPs."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl4llm import parallel
from jaxrl4llm.planner import hlo_analysis

MESH = parallel.make_mesh("data:1,fsdp:8,tensor:1")


def _put(shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(MESH, spec))


def test_collectives_inside_a_loop_count_each_iteration():
    def f(w_LDF, x_BD):
        def body(x, w):  # w sharded over its rows: gathered once per iteration
            return jnp.tanh(x @ w), None

        return jax.lax.scan(body, x_BD, w_LDF)[0]

    hlo = (
        jax.jit(f)
        .lower(_put((5, 64, 64), P(None, "fsdp")), _put((16, 64), P("fsdp")))
        .compile()
        .as_text()
    )
    gathers = [op for op in hlo_analysis.collectives(hlo) if op.kind == "all-gather"]
    weight = [op for op in gathers if op.result[0].dims == (64, 64)]
    assert weight and all(op.executions == 5 and op.group_size == 8 for op in weight)
    assert sum(op.total_bytes for op in weight) == 5 * 64 * 64 * 4
    # 5 iterations of a [16/8, 64] x [64, 64] matmul per device.
    assert hlo_analysis.matmul_flops(hlo) == 5 * 2 * 2 * 64 * 64


def test_sliced_all_reduce_is_a_reduce_scatter_and_bf16_counts_at_its_width():
    def grad_like(x_BD, y_BF):  # batch-sharded operands, result sharded over its rows
        out = jnp.einsum("bd,bf->df", x_BD, y_BF, preferred_element_type=jnp.float32)
        return jax.lax.with_sharding_constraint(out, NamedSharding(MESH, P("fsdp")))

    hlo = (
        jax.jit(grad_like)
        .lower(_put((16, 32), P("fsdp")), _put((16, 48), P("fsdp")))
        .compile()
        .as_text()
    )
    ops = hlo_analysis.collectives(hlo)
    assert [op.kind for op in ops] == ["reduce-scatter"]
    assert ops[0].bytes == 32 * 48 * 4 and ops[0].link_bytes == 32 * 48 * 4 * 7 / 8

    def gather_bf16(w, x):  # the weight gathered whole, then a float32-accumulated matmul
        w = jax.lax.with_sharding_constraint(w, NamedSharding(MESH, P()))
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    hlo = (
        jax.jit(gather_bf16)
        .lower(_put((64, 32), P("fsdp"), jnp.bfloat16), _put((16, 64), P(), jnp.bfloat16))
        .compile()
        .as_text()
    )
    gathers = [op for op in hlo_analysis.collectives(hlo) if op.kind == "all-gather"]
    assert gathers and all(op.bytes == 64 * 32 * 2 for op in gathers)  # bf16, not f32


def _loop(w_DD, x_BD, gather_first: bool):
    """x <- tanh(x @ w) until its sum is small: a loop of unknown length over one weight."""
    if gather_first:  # the weight whole before the loop: its matmuls need no collective
        w_DD = jax.lax.with_sharding_constraint(w_DD, NamedSharding(MESH, P()))
    x_BD = jax.lax.with_sharding_constraint(x_BD, NamedSharding(MESH, P("fsdp")))
    return jax.lax.while_loop(
        lambda x: jnp.sum(x) > 1.0,
        lambda x: jax.lax.with_sharding_constraint(
            jnp.tanh(x @ w_DD), NamedSharding(MESH, P("fsdp"))
        ),
        x_BD,
    )


def test_loop_invariant_collectives_are_read_where_the_partitioner_put_them():
    args = (_put((64, 64), P("fsdp")), _put((16, 64), P("fsdp")))
    compiled, hlo = hlo_analysis.partitioned_hlo(
        jax.jit(lambda w, x: _loop(w, x, False)).lower(*args)
    )
    repeated = hlo_analysis.loop_invariant_collectives(hlo, unknown_trip_count=7)
    # The weight's shards gathered in every iteration: [8, 64] -> [64, 64] float32.
    assert [(op.kind, op.result[0].dims, op.executions) for op in repeated] == [
        ("all-gather", (64, 64), 7)
    ]
    assert repeated[0].bytes == 64 * 64 * 4
    # The CPU compiler hoists it out of the loop: its final HLO does not show the problem.
    assert not hlo_analysis.loop_invariant_collectives(compiled.as_text())
    _, hlo = hlo_analysis.partitioned_hlo(jax.jit(lambda w, x: _loop(w, x, True)).lower(*args))
    assert not hlo_analysis.loop_invariant_collectives(hlo)
    assert [op.kind for op in hlo_analysis.collectives(hlo) if op.result[0].dims == (64, 64)] == [
        "all-gather"
    ]


def test_a_weight_sliced_per_iteration_is_not_loop_invariant():
    def f(w_LDF, x_BD):  # the scan's slice of the stacked weight changes every iteration
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x_BD, w_LDF)[0]

    _, hlo = hlo_analysis.partitioned_hlo(
        jax.jit(f).lower(_put((5, 64, 64), P(None, "fsdp")), _put((16, 64), P("fsdp")))
    )
    assert any(op.kind == "all-gather" for op in hlo_analysis.collectives(hlo))
    assert not hlo_analysis.loop_invariant_collectives(hlo)


def test_a_shard_map_body_counts_and_a_nested_unknown_loop_runs_once_per_outer_iteration():
    """A psum in a loop inside a loop, both of unknown length, in a shard_map body (a call in
    the partitioned HLO, manual over fsdp): the outer loop runs `unknown_trip_count` times,
    the inner one once per outer iteration (as the paged engine's admission loop inside its
    decode loop), so the psum runs 7 times, not 49 (and not 0: a call's body counts)."""

    def per_device(x_B):
        def inner(x):
            return jax.lax.while_loop(
                lambda y: jnp.sum(y) > 1.0, lambda y: jax.lax.psum(y, "fsdp") / 16.0, x
            )

        return jax.lax.while_loop(lambda x: jnp.sum(x) > 2.0, lambda x: inner(x) / 2.0, x_B)

    run = jax.shard_map(
        per_device, mesh=MESH, in_specs=P("fsdp"), out_specs=P("fsdp"), check_vma=False
    )
    _, hlo = hlo_analysis.partitioned_hlo(jax.jit(run).lower(_put((16,), P("fsdp"))))
    psums = [op for op in hlo_analysis.collectives(hlo, unknown_trip_count=7)]
    assert [(op.kind, op.group_size, op.executions) for op in psums] == [("all-reduce", 8, 7)]


def test_a_conditional_counts_its_heaviest_branch_not_the_sum_of_its_branches():
    """The paged engine's loop picks one decode step of several row levels per iteration (a
    conditional): a loop of 5 iterations whose branches do one, two or no [16, 64] x [64, 64]
    matmuls costs 5 x 2 of them, not 5 x 3; a psum in the lighter branch is not counted."""

    def f(w_DF, x_BD, level):
        def body(x, _):
            branches = (
                lambda x: jax.lax.psum(x @ w_DF, "fsdp"),
                lambda x: jnp.tanh(jnp.tanh(x @ w_DF) @ w_DF),
                lambda x: x + 1.0,
            )
            return jax.lax.switch(level, branches, x), None

        return jax.lax.scan(body, x_BD, None, length=5)[0]

    run = jax.shard_map(f, mesh=MESH, in_specs=(P(), P(), P()), out_specs=P(), check_vma=False)
    hlo = (
        jax.jit(run)
        .lower(
            _put((64, 64), P()),
            _put((16, 64), P()),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(MESH, P())),
        )
        .compile()
        .as_text()
    )
    assert "conditional(" in hlo
    assert hlo_analysis.matmul_flops(hlo) == 5 * 2 * (2 * 16 * 64 * 64)
    assert not [op for op in hlo_analysis.collectives(hlo) if op.kind == "all-reduce"]


def test_limits_cap_the_executions_of_a_named_scope():
    """A matmul under a named scope in a loop of 7 unknown iterations, the scope limited to 2
    runs (the paged engine's prefill, once per admitted block), another matmul outside it."""

    def f(w_DF, x_BD):
        def body(x):
            with jax.named_scope("once_per_block"):
                y = jnp.tanh(x @ w_DF)
            return jnp.tanh(y @ w_DF)

        return jax.lax.while_loop(lambda x: jnp.sum(x) > 0.0, body, x_BD)

    arg = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    hlo = jax.jit(f).lower(arg, jax.ShapeDtypeStruct((16, 64), jnp.float32)).compile().as_text()
    one = 2 * 16 * 64 * 64
    assert hlo_analysis.matmul_flops(hlo, unknown_trip_count=7) == 14 * one
    limited = hlo_analysis.matmul_flops(hlo, unknown_trip_count=7, limits={"/once_per_block/": 2})
    assert limited == (7 + 2) * one
