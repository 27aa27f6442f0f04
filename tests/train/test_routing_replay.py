"""Rollout routing replay and the routers' training signals (--routing_replay,
--router_aux_loss_coef, --router_z_loss_coef): the sampler's record of each token's experts,
its replay in the teacher-forced passes, the router's losses in the update against
transformers, and the flags through the trainer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import TINY
from jaxrl4llm.models.moe_config import MoeConfig
from jaxrl4llm.sampling import sampler
from jaxrl4llm.sampling.strategies import SamplingConfig
from jaxrl4llm.train import loop
from jaxrl4llm.train.config.checks import validate
from jaxrl4llm.train.infra.metrics import read_metrics
from jaxrl4llm.train.update import step
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import Sequences, completion_logprobs

from tests.compacted_reference import compacted_rollouts
from tests.conftest import build_toy_model
from tests.train.test_loop import _config, _one_device

# 8 experts, top-2 renormalised (Qwen3-MoE's rule); layer 0 dense, layers 1-2 sparse.
MOE = dataclasses.replace(
    TINY,
    num_layers=3,
    model_type="qwen3_moe",
    qk_norm=True,
    moe=MoeConfig(8, 2, 16, norm_topk_prob=True, mlp_only_layers=(0,)),
)
PROMPTS = [[3, 5, 7, 9], [4, 6, 8, 10, 12, 14], [11, 13]]
G, N = 3, 6


@pytest.fixture(scope="module")
def sampled():
    params = transformer.init_params(MOE, jax.random.key(0))
    out = sampler.generate(
        params,
        MOE,
        PROMPTS,
        SamplingConfig(1.0),
        N,
        jax.random.key(1),
        n=G,
        stop_ids=(),
        record_routing=True,
    )
    return params, out


def _rows(out, **record):
    return Sequences(out.prompt_tokens_BP, out.prompt_mask_BP, out.tokens_BT, out.mask_BT, **record)


def test_the_sampler_records_the_experts_each_token_ran(sampled):
    """The record equals the routers' top-k of an uncached teacher-forced pass over prompt +
    completion (another code path than the cached decode): prompt tokens from the prefill,
    completion token t from the decode step that fed it; the last token is never fed."""
    params, out = sampled
    B, P = out.prompt_tokens_BP.shape
    assert out.prompt_experts_BPLK.shape == (B, P, 2, 2) and out.experts_BTLK.dtype == jnp.uint8
    tokens, mask, positions = out.sequences()
    _, _, routing = transformer.routed_hidden_states(params, MOE, tokens, positions, mask)
    want_BSLK = np.sort(np.moveaxis(np.asarray(routing.experts_BTK), 0, 2), axis=-1)
    got_BSLK = np.sort(np.concatenate([out.prompt_experts_BPLK, out.experts_BTLK], axis=1), axis=-1)
    real = np.asarray(mask).copy()
    real[:, -1] = False  # the last completion token: never fed
    np.testing.assert_array_equal(got_BSLK[real], want_BSLK[real])


def test_replay_runs_the_recorded_experts(sampled):
    """A record equal to the routers' own choice changes nothing; another record changes the
    logprobs, by as much as running those experts does (the layers' replay argument);
    without `replay` the record is only compared, never run."""
    params, out = sampled
    own, _ = completion_logprobs(params, MOE, _rows(out), prompt_group=G)
    record = dict(prompt_experts_BPLK=out.prompt_experts_BPLK, experts_BTLK=out.experts_BTLK)
    same, _ = completion_logprobs(params, MOE, _rows(out, **record), prompt_group=G)
    np.testing.assert_allclose(same, own, atol=1e-6)
    shifted = {k: (v + 1) % 8 for k, v in record.items()}  # every token, other experts
    moved, _ = completion_logprobs(params, MOE, _rows(out, **shifted), prompt_group=G)
    ignored, _ = completion_logprobs(
        params, MOE, _rows(out, **shifted, replay=False), prompt_group=G
    )
    mask = np.asarray(out.mask_BT)
    assert np.abs(np.asarray(moved - own))[mask].max() > 1e-3
    np.testing.assert_allclose(ignored, own, atol=1e-6)
    # Shared prompts or not: the same replayed pass.
    unshared, _ = completion_logprobs(params, MOE, _rows(out, **shifted), prompt_group=1)
    np.testing.assert_allclose(unshared, moved, atol=1e-5)


def test_the_updates_router_losses_equal_transformers(sampled):
    """loss(aux c1, z c2) - loss(0, 0) = c1 * transformers' load_balancing_loss_func + c2 *
    the z-loss (numpy) over the rows' real input tokens (prompts unshared, so each token once),
    and the flip metric is 0 when the trainer routes as the record says."""
    torch = pytest.importorskip("torch")
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    params, out = sampled
    record = dict(prompt_experts_BPLK=out.prompt_experts_BPLK, experts_BTLK=out.experts_BTLK)
    seqs = _rows(out, **record)
    B = seqs.completion_tokens_BT.shape[0]
    batch = UpdateBatch(seqs, jnp.ones(B), jnp.ones(B, bool), None, None)
    kwargs = dict(
        model_config=MOE,
        algorithm=rl.get_preset("grpo", kl_coef=0.0),
        temperature=1.0,
        remat=False,
        prompt_group=1,
        sharding=None,
    )
    loss = lambda coefs: step._micro_loss(params, batch, 1.0, router_coefs=coefs, **kwargs)  # noqa: E731
    base, metrics = loss((0.0, 0.0))
    with_terms, _ = loss((0.3, 0.05))
    tokens, mask, positions = out.sequences()
    tokens, mask, positions = tokens[:, :-1], mask[:, :-1], positions[:, :-1]
    _, _, routing = transformer.routed_hidden_states(params, MOE, tokens, positions, mask)
    logits = np.asarray(routing.logits_BTE, np.float32)  # [L, B, S, E]
    L, _, S, E = logits.shape
    gate = tuple(torch.tensor(layer.reshape(B * S, E)) for layer in logits)
    balance = float(
        qwen3_moe.load_balancing_loss_func(
            gate, E, 2, torch.tensor(np.asarray(mask).astype(np.int64))
        )
    )
    z_all = np.log(np.exp(logits).sum(-1)) ** 2
    z = (z_all * np.asarray(mask)[None]).sum() / (L * np.asarray(mask).sum())
    np.testing.assert_allclose(with_terms - base, 0.3 * balance + 0.05 * z, rtol=1e-4)
    assert float(metrics["router/flip_frac"].value) == 0.0


# Metrics of the machine's time and memory, not of the run's numbers.
_RUN_DEPENDENT = {"memory/peak_rss_gib", "throughput/rollout_tokens_per_s"} | {
    f"time/{part}_s" for part in ("logprobs", "reward", "rollout", "step", "update")
}


def test_router_flags_through_the_trainer(tmp_path, copy_task_file):
    """--routing_replay with the router's losses runs and logs the router metrics, by the
    paged engine (its pool holds a group or two at a time) as by the compacted sampler (the
    tests' reference); the
    flags are refused on a dense model and with rollouts that keep no record (exit 2)."""
    model = build_toy_model(
        tmp_path / "moe", model_type="qwen3_moe", qk_norm=True, moe=MoeConfig(4, 2, 32)
    )
    config = _config(
        model,
        copy_task_file,
        tmp_path / "run",
        num_steps=2,
        max_new_tokens=4,
        mini_batch_size=16,
        routing_replay=True,
        router_aux_loss_coef=0.01,
        router_z_loss_coef=0.001,
    )
    with compacted_rollouts():
        loop.run(config, devices=_one_device())
    # 12 pages, 8 rows decoding at once: groups wait for rows and pages.
    paged = config.replace(
        workdir=str(tmp_path / "paged"), kv_cache_tokens=192, rollout_micro_batch=8
    )
    loop.run(paged, devices=_one_device())
    records = read_metrics(str(tmp_path / "run"))
    for ra, rb in zip(records, read_metrics(str(tmp_path / "paged")), strict=True):
        assert 1 <= rb["rollout/rows_per_decode_step"] <= 8
        for name in ra.keys() - _RUN_DEPENDENT:
            np.testing.assert_allclose(rb[name], ra[name], rtol=1e-5, atol=1e-6, err_msg=name)
    last = records[-1]
    # Two updates per rollout: the second mini-batch's routers moved after the first.
    assert 0 <= last["router/flip_frac"] < 0.5
    assert last["router/aux_loss"] >= 2.0 - 1e-4  # >= k, its balanced value
    assert 1.0 <= last["router/load_max_over_mean"] <= 4 / 2
    dense = build_toy_model(tmp_path / "dense")
    with pytest.raises(FlagError, match="--routing_replay, --router_aux_loss_coef.*is dense"):
        loop.run(config.replace(model=dense, workdir=str(tmp_path / "d")), devices=_one_device())
    with pytest.raises(FlagError, match="--routing_replay replays the routing"):
        validate(config.replace(partial_rollout_tokens=2), 1)
    with pytest.raises(FlagError, match="--micro_batch_tokens=64: the packed passes"):
        validate(config.replace(micro_batch_tokens=64), 1)
