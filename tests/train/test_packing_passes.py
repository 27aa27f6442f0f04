"""--micro_batch_tokens in the rollout's teacher-forced passes: the reference / old logprobs
and PPO's values computed on packed rows equal the padded passes' (completion_logprobs_jit,
critic.values_jit: row per sequence, which know nothing of packing and are checked against
an independent forward in tests/train/test_step.py and tests/train/test_critic.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import parallel
from jaxrl4llm.models import transformer
from jaxrl4llm.train.update import critic, packing
from jaxrl4llm.train.update.logprobs import completion_logprobs_jit

from tests.train.test_packing import COMP_LEN, CONFIG, GROUPS, P, _batch

FLOPS = packing.SlotFlops.of(CONFIG)


def _multi_turn_seqs(groups=None):
    """test_packing's mixed lengths (prompts of 2-6 tokens, completions of 1-12; `groups`:
    rows sharing a prompt), row 0 a multi-turn trajectory: its completion tokens 3-5 an
    observation (in the sequence, off the loss mask), row 2's tokens 1-2 too."""
    _, batch = _batch(seed=3, groups=groups)
    seqs = batch.seqs
    mask = np.asarray(seqs.completion_mask_BT).copy()
    observation = np.zeros_like(mask)
    for row, cols in ((0, slice(3, 6)), (2, slice(1, 3))):
        observation[row, cols], mask[row, cols] = True, False
    assert COMP_LEN[0] > 6 and COMP_LEN[2] > 3  # the observations sit inside the completions
    return seqs.replace(
        completion_mask_BT=jnp.asarray(mask), observation_mask_BT=jnp.asarray(observation)
    )


def _params(seed):
    return transformer.init_params(CONFIG, jax.random.key(seed))


@pytest.mark.parametrize(
    "budget, groups", [(18, None), (36, None), (96, None), (24, GROUPS), (96, GROUPS)]
)
def test_packed_logprobs_equal_the_padded_pass(budget, groups):
    """Reference (other weights) and old logprobs at temperature 0.9, budgets from the
    longest sequence (one row per micro-batch) to all in one micro-batch; with groups
    sharing a prompt, split over rows (24) or not (96)."""
    seqs = _multi_turn_seqs(groups)
    packed = packing.pack(seqs, budget, flops=FLOPS)
    assert int(packed.num_micro) > 1 or budget == 96
    for seed in (0, 1):
        params = _params(seed)
        expected = completion_logprobs_jit(params, CONFIG, seqs, 0.9)
        got = packing.logprobs_jit(params, CONFIG, packed, seqs.completion_mask_BT, 0.9)
        assert got.shape == expected.shape == seqs.completion_mask_BT.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=1e-5)
        # Every loss token holds a logprob; observation tokens and padding hold 0.
        mask = np.asarray(seqs.completion_mask_BT)
        assert (np.asarray(got)[mask] < 0).all() and (np.asarray(got)[~mask] == 0).all()


def test_packed_values_equal_the_padded_pass():
    seqs = _multi_turn_seqs()
    params = critic.from_policy(_params(0))
    params[critic.HEAD] = jax.random.normal(jax.random.key(2), params[critic.HEAD].shape)
    expected = critic.values_jit(params, CONFIG, seqs)
    packed = packing.pack(seqs, 36, flops=FLOPS)
    got = critic.packed_values_jit(params, CONFIG, packed, seqs.completion_mask_BT)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(expected).max()) > 1e-2


def test_packed_logprobs_on_8_devices_equal_one_device():
    """data x fsdp = 2 x 4, shared prompts: each micro-batch is R packed rows per device."""
    seqs = _multi_turn_seqs(GROUPS)
    params = _params(0)
    expected = completion_logprobs_jit(params, CONFIG, seqs, 1.0)
    mesh = parallel.make_mesh("data:2,fsdp:4,tensor:1")
    packed = packing.pack_on_mesh(seqs, 8 * (P + 12), mesh, flops=FLOPS)
    assert packed.tokens_KRL.shape[1] % 8 == 0  # R rows per device
    assert len(packed.tokens_KRL.sharding.device_set) == 8
    sharded_params = parallel.shard_pytree(params, transformer.param_logical_axes(CONFIG), mesh)
    mask = jax.device_put(seqs.completion_mask_BT, parallel.batch_sharding(mesh, 2))
    got = packing.logprobs_jit(
        sharded_params, CONFIG, packed, mask, 1.0, sharding=parallel.ActivationSharding(mesh)
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=1e-5)
