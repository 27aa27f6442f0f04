"""LoRA in the update: the adapters' gradient is the chain rule of the base weights', the base
gets no gradient (the compiled update computes none) and no optimizer state, and a run's
reference is the base itself (no copy)."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm import rl
from jaxrl4llm.models import lora as lora_lib
from jaxrl4llm.models import transformer
from jaxrl4llm.train import services
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.update.adapters import trainable
from jaxrl4llm.train.update.state import OptimizerConfig, TrainState
from jaxrl4llm.train.update.step import accumulate_gradients, train_step

from tests.train.float_checks import LINEAR_OPT
from tests.train.test_loop import _config, _one_device
from tests.train.test_step import CONFIG, _batch

LORA = lora_lib.LoraConfig(rank=3, alpha=6.0)
GRPO = rl.get_preset("dr_grpo")


def _random_b(adapters):
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    return jax.tree.unflatten(
        treedef,
        [
            x if x.ndim and float(jnp.abs(x).max()) else 0.05 * jax.random.normal(k, x.shape)
            for k, x in zip(keys, leaves)
        ],
    )


def _grads(params, batch, **kwargs):
    return accumulate_gradients(
        params, batch, model_config=CONFIG, algorithm=GRPO, num_micro=2, temperature=1.0, **kwargs
    )


def test_adapter_gradients_follow_the_chain_rule_of_the_merged_weights():
    """With W' = W + s A B: dL/dB = s A^T dL/dW' and dL/dA = s dL/dW' B^T, where dL/dW' is the
    full fine-tuning gradient at the merged weights (another forward: no adapter matmuls)."""
    base = transformer.init_params(CONFIG, jax.random.key(0))
    adapters = _random_b(lora_lib.init_adapters(CONFIG, LORA, jax.random.key(1)))
    _, batch, _ = _batch()
    loss_lora, g_lora, _ = _grads(adapters, batch, frozen=base, lora=LORA)
    loss_full, g_full, _ = _grads(lora_lib.merge(base, adapters, LORA), batch)
    np.testing.assert_allclose(loss_lora, loss_full, rtol=1e-5)
    assert jax.tree.structure(g_lora) == jax.tree.structure(adapters)
    s = LORA.scale
    for target in ("q", "o", "down"):
        a = np.asarray(adapters["layers"][f"{target}_lora_a"])
        b = np.asarray(adapters["layers"][f"{target}_lora_b"])
        gw = np.asarray(g_full["layers"][target]).reshape(a.shape[0], a.shape[1], b.shape[2])
        np.testing.assert_allclose(
            g_lora["layers"][f"{target}_lora_b"],
            s * np.einsum("lir,lio->lro", a, gw),
            atol=2e-6,
            rtol=1e-4,
        )
        np.testing.assert_allclose(
            g_lora["layers"][f"{target}_lora_a"],
            s * np.einsum("lio,lro->lir", gw, b),
            atol=2e-6,
            rtol=1e-4,
        )


def _weight_gradient_dots(hlo: str) -> list[str]:
    """Dot results shaped like a base weight matrix (per layer, any head split): the shape of
    a weight's gradient; no activation here has one (B*T = 8 * 11 rows)."""
    c = CONFIG
    D, F, V, N, K, H = (
        c.hidden_size,
        c.intermediate_size,
        c.vocab_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
    )
    shapes = {
        (D, F),
        (F, D),
        (D, N * H),
        (N * H, D),
        (D, K * H),
        (K * H, D),
        (D, N, H),
        (N, H, D),
        (D, K, H),
        (V, D),
        (D, V),
    }
    found = []
    for m in re.finditer(r"= f32\[([\d,]+)\]\{[^}]*\} dot\(", hlo):
        shape = tuple(int(d) for d in m.group(1).split(","))
        if shape in shapes:
            found.append(m.group(0))
    return found


def test_the_compiled_update_computes_no_base_gradient_and_keeps_no_base_moments():
    base = transformer.init_params(CONFIG, jax.random.key(0))
    adapters = lora_lib.init_adapters(CONFIG, LORA, jax.random.key(1))
    _, batch, _ = _batch()
    static = dict(
        model_config=CONFIG, algorithm=GRPO, optimizer=LINEAR_OPT, num_micro=2, temperature=1.0
    )
    full = TrainState.create(base, LINEAR_OPT, 0)
    lora = TrainState.create(adapters, LINEAR_OPT, 0)
    full_hlo = train_step.lower(full, batch, **static).compile().as_text()
    lora_hlo = train_step.lower(lora, batch, frozen=base, lora=LORA, **static).compile().as_text()
    assert _weight_gradient_dots(full_hlo)  # the check sees full fine-tuning's
    assert not _weight_gradient_dots(lora_hlo)
    # The optimizer state: moments of the adapters only.
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    assert nbytes(lora.opt_state) <= 2 * nbytes(adapters) + 64
    assert nbytes(lora.opt_state) < nbytes(full.opt_state) / 5
    new_state, metrics = train_step(lora, batch, frozen=base, lora=LORA, **static)
    assert float(metrics["optim/update_norm"].value) > 0
    assert jax.tree.structure(new_state.params) == jax.tree.structure(adapters)


def test_a_lora_run_uses_the_base_as_its_reference(toy_model_dir, copy_task_file, tmp_path):
    config = _config(
        toy_model_dir,
        copy_task_file,
        tmp_path,
        algorithm=rl.get_preset("grpo", kl_coef=0.1),
        lora_rank=4,
    )
    models, run = services.setup(config, _one_device())
    try:
        assert models.ref_params is models.base_params  # the same arrays: no copy
        assert sorted(models.state.params["layers"]) == sorted(
            f"{t}_lora_{x}" for t in lora_lib.TARGETS for x in "ab"
        )
        # Step 0: the policy is the base model exactly.
        tokens = jnp.asarray([[3, 4, 5, 6]], jnp.int32)
        mask = jnp.ones_like(tokens, bool)
        pos = transformer.positions_from_mask(mask)
        np.testing.assert_array_equal(
            transformer.forward(models.policy_params(), run.model_config, tokens, pos, mask)[0],
            transformer.forward(models.base_params, run.model_config, tokens, pos, mask)[0],
        )
    finally:
        run.close()


def test_a_bfloat16_base_trains_float32_adapters_by_adams_step():
    """Over a bfloat16 base the adapters, their gradients and Adam moments are float32, and a
    step of lr = 1e-5 moves B by numpy's float32 Adam step (bias-corrected first step: lr g /
    (|g| + eps)); bfloat16 adapters (|B| in [0.05, 0.1]: an ulp of 2.4e-4 to 4.9e-4) round
    the same step away entirely."""
    base = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16), transformer.init_params(CONFIG, jax.random.key(0))
    )
    fresh = trainable(LORA, CONFIG, base, seed=0)
    assert {x.dtype for x in jax.tree.leaves(fresh)} == {jnp.dtype(jnp.float32)}
    u = np.random.default_rng(3).uniform(-1, 1, fresh["layers"]["q_lora_b"].shape)
    b0 = (np.sign(u) * (0.05 + 0.05 * np.abs(u))).astype(np.float32)
    trained = {"layers": {**fresh["layers"], "q_lora_b": jnp.asarray(b0)}}
    _, batch, _ = _batch()
    opt = OptimizerConfig(learning_rate=1e-5, max_grad_norm=0.0)
    static = dict(model_config=CONFIG, algorithm=GRPO, optimizer=opt, num_micro=2, temperature=1.0)

    _, grads, _ = _grads(trained, batch, frozen=base, lora=LORA)
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    as_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), trained)
    state, _ = train_step(  # donates the state: `trained` is gone after this
        TrainState.create(trained, opt, 0), batch, frozen=base, lora=LORA, **static
    )
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert len(floats) == 3 * len(jax.tree.leaves(trained))  # the adapters and 2 moments
    assert {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}

    g = np.asarray(grads["layers"]["q_lora_b"], np.float32)
    m, v = (1 - opt.b1) * g, (1 - opt.b2) * g * g
    m_hat, v_hat = m / (1 - opt.b1), v / (1 - opt.b2)
    step = -np.float32(opt.learning_rate) * m_hat / (np.sqrt(v_hat) + np.float32(opt.eps))
    assert np.median(np.abs(step)) > 0.9 * opt.learning_rate  # ~ lr * sign(g)
    np.testing.assert_allclose(
        np.asarray(state.params["layers"]["q_lora_b"]), b0 + step, rtol=0, atol=2e-8
    )

    b0_bf16 = np.asarray(as_bf16["layers"]["q_lora_b"])
    state_bf16, _ = train_step(
        TrainState.create(as_bf16, opt, 0), batch, frozen=base, lora=LORA, **static
    )
    np.testing.assert_array_equal(np.asarray(state_bf16.params["layers"]["q_lora_b"]), b0_bf16)


def test_a_lora_run_over_a_bfloat16_base_is_not_warned_about_rounding():
    """The bfloat16 base is frozen and the adapters are float32: no update rounds away."""
    warned = TrainConfig().replace(param_dtype="bfloat16", learning_rate=1e-6)
    assert len(warned.precision_warnings()) == 1
    assert not warned.replace(lora_rank=8).precision_warnings()
