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
from jaxrl4llm.train.state import TrainState
from jaxrl4llm.train.step import accumulate_gradients, train_step

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
