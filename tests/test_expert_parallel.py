"""Expert parallelism on the 8 fake CPU devices: a mixture of experts split over the
`expert` mesh axis (with fsdp, tensor and data) computes the unsharded model's values,
routing and gradients; its decode loop moves tokens, never a weight."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import parallel
from jaxrl4llm.models import transformer as T
from jaxrl4llm.models.config import TINY
from jaxrl4llm.models.moe_config import MoeConfig
from jaxrl4llm.planner import hlo_analysis
from jaxrl4llm.sampling import decode, sampler
from jaxrl4llm.sampling.strategies import SamplingConfig

# Qwen2-MoE-shaped: 8 experts, top-2 renormalised, a shared expert.
MOE = dataclasses.replace(
    TINY,
    model_type="qwen2_moe",
    attention_bias=True,
    moe=MoeConfig(
        num_experts=8,
        experts_per_token=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        shared_expert_intermediate_size=48,
    ),
)
# Layer 0 dense (the layers run as a loop), 6 experts: not divisible by expert=4.
MIXED = dataclasses.replace(
    MOE, moe=dataclasses.replace(MOE.moe, num_experts=6, mlp_only_layers=(0,))
)


@functools.cache
def _params(config):
    # Sharper routers than init's 0.02 scale, so top-k decisions are clear-cut.
    params = T.init_params(config, jax.random.key(0))
    return jax.tree.map(lambda w: 20.0 * w if w.ndim >= 3 else w, params)


def _batch():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (8, 9)), jnp.int32)
    mask = jnp.asarray(np.arange(9)[None] >= rng.integers(0, 4, (8, 1)))
    probe = jnp.asarray(rng.standard_normal((8, 9, TINY.hidden_size)), jnp.float32)
    return tokens, mask, probe


@functools.partial(jax.jit, static_argnums=(1, 2))
def _value_and_grad(params, config, sharding, replay):
    tokens, mask, probe = _batch()

    def loss(p):
        positions = T.positions_from_mask(mask)
        h, _, routing = T.routed_hidden_states(
            p, config, tokens, positions, mask, sharding=sharding, experts_LBTK=replay
        )
        return jnp.sum(jnp.where(mask[..., None], h * probe, 0.0)), routing

    return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.mark.parametrize(
    "config,mesh_spec,replay",
    [
        (MOE, "fsdp:2,expert:4", False),
        (MOE, "expert:8", False),
        (MOE, "fsdp:2,expert:2,tensor:2", True),
        (MOE, "data:2,expert:2,tensor:2", False),
        (MIXED, "fsdp:2,expert:4", True),
    ],
)
def test_sharded_values_routing_and_gradients_equal_unsharded(config, mesh_spec, replay):
    params = _params(config)
    (ref, routing), grads = _value_and_grad(params, config, None, None)
    mesh = parallel.make_mesh(mesh_spec)
    sharded = parallel.shard_pytree(params, T.param_logical_axes(config), mesh)
    if config.moe.num_experts % mesh.shape["expert"] == 0:
        assert sharded["layers"]["expert_gate"].sharding.spec[1] == "expert"
    sharding = parallel.ActivationSharding(mesh)
    (value, routing_s), grads_s = _value_and_grad(sharded, config, sharding, None)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    np.testing.assert_array_equal(routing_s.experts_BTK, routing.experts_BTK)
    np.testing.assert_allclose(routing_s.logits_BTE, routing.logits_BTE, atol=1e-4, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_s), jax.tree.leaves(grads)):
        scale = float(jnp.abs(b).max())
        assert scale > 0, path
        np.testing.assert_allclose(a, b, atol=2e-5 * scale, err_msg=jax.tree_util.keystr(path))
    if replay:  # replaying other experts on the mesh equals replaying them unsharded
        _check_replay(params, sharded, config, sharding, routing.experts_BTK, float(ref))


def _check_replay(params, sharded, config, sharding, experts_LBTK, ref):
    others = experts_LBTK.at[..., 0].set((experts_LBTK[..., 1] + 1) % config.moe.num_experts)
    (ref_r, _), grads_r = _value_and_grad(params, config, None, others)
    (value_r, routing_r), grads_rs = _value_and_grad(sharded, config, sharding, others)
    np.testing.assert_array_equal(routing_r.experts_BTK, others)
    np.testing.assert_allclose(value_r, ref_r, rtol=1e-5)
    assert abs(float(ref_r) - ref) > 1e-3 * abs(ref)  # other experts ran
    router, router_s = grads_r["layers"]["router"], grads_rs["layers"]["router"]
    np.testing.assert_allclose(router_s, router, atol=2e-5 * float(jnp.abs(router).max()))


def _lower(mesh_spec: str):
    """The sampler's program for MOE on the mesh, with bfloat16 params laid out as stored."""
    mesh = parallel.make_mesh(mesh_spec)
    structs = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16),
        T.param_shapes(MOE),
        is_leaf=T.is_shape,
    )
    shardings = parallel.logical_to_sharding(T.param_logical_axes(MOE), mesh, shapes=structs)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), structs, shardings
    )

    def rows(shape, dtype):
        return jax.ShapeDtypeStruct(
            shape, dtype, sharding=parallel.batch_sharding(mesh, len(shape))
        )

    return mesh, sampler.generate_tokens.lower(
        params,
        rows((16, 8), jnp.int32),
        rows((16, 8), bool),
        rows((16,), bool),
        rows((16,), jax.random.key(0).dtype),
        jax.ShapeDtypeStruct((8,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
        model_config=MOE,
        sampling=SamplingConfig(),
        max_new_tokens=4,
        mesh=mesh,
        prompt_group=1,
        num_chunks=1,
        cache_dtype=jnp.bfloat16,
    )


def _gathered_bytes(mesh) -> int:
    """Per-device bytes of every FSDP-sharded weight once whole over fsdp (bfloat16), still
    split over tensor (its first divisible dim asking) and, the experts', over expert: the
    logical axes read directly, not through the sharding code."""
    tensor, expert = mesh.shape["tensor"], mesh.shape["expert"]
    total = 0
    for axes, shape in zip(
        jax.tree.leaves(T.param_logical_axes(MOE), is_leaf=lambda x: type(x) is tuple),
        jax.tree.leaves(T.param_shapes(MOE), is_leaf=T.is_shape),
    ):
        if "embed" not in axes:
            continue
        dims = dict(zip(axes, shape))
        on_tensor = [d for a, d in dims.items() if a in ("vocab", "heads", "kv_heads", "mlp")]
        pieces = tensor if any(d % tensor == 0 for d in on_tensor) else 1
        pieces *= expert if dims.get("experts", 1) % expert == 0 and "experts" in dims else 1
        total += 2 * math.prod(shape) // pieces
    return total


@pytest.mark.parametrize("mesh_spec", ["fsdp:2,expert:4", "fsdp:2,expert:2,tensor:2"])
def test_decode_loop_moves_no_weight_and_keeps_experts_split(mesh_spec):
    mesh, lowered = _lower(mesh_spec)
    _, hlo = hlo_analysis.partitioned_hlo(lowered)
    assert " while(" in hlo
    repeated = hlo_analysis.loop_invariant_collectives(hlo)
    assert not repeated, [(op.kind, op.result, op.op_name) for op in repeated]
    once = [op for op in hlo_analysis.collectives(hlo) if f"/{decode.WEIGHTS_SCOPE}/" in op.op_name]
    assert once and all(op.kind == "all-gather" and op.executions == 1 for op in once)
    # Gathered over fsdp only: each device keeps its own experts (E / expert of them).
    assert sum(op.bytes for op in once) == _gathered_bytes(mesh)


def test_the_routing_record_on_a_mesh_equals_one_devices():
    """The sampler's routing record (routing replay), its rows over the batch axes and the
    experts split over `expert`, holds the one-device run's tokens and experts."""
    params = _params(MOE)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    run = functools.partial(
        sampler.generate,
        model_config=MOE,
        prompts=prompts,
        sampling=SamplingConfig(1.0),
        max_new_tokens=5,
        key=jax.random.key(3),
        n=2,
        stop_ids=(),
        record_routing=True,
    )
    one = run(params)
    mesh = parallel.make_mesh("data:2,fsdp:2,expert:2", jax.devices()[:8])
    many = run(parallel.shard_pytree(params, T.param_logical_axes(MOE), mesh), mesh=mesh)
    np.testing.assert_array_equal(many.tokens_BT, one.tokens_BT)
    for name in ("prompt_experts_BPLK", "experts_BTLK"):
        np.testing.assert_array_equal(
            np.sort(getattr(many, name), -1), np.sort(getattr(one, name), -1), err_msg=name
        )
