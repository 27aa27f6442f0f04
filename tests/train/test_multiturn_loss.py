"""Observation tokens of a multi-turn trajectory are in the sequence but off the loss: a
hand-built two-turn batch's loss and gradients (each aggregation, with KL and entropy) equal
the single-turn loss over the model tokens alone, computed here from a plain forward over each
row's whole sequence; the advantages see one reward per trajectory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.models import transformer, unembedding
from jaxrl4llm.rl.losses import AGG_MODES
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.train.update import step
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import Sequences

P, T = 5, 10
# Per row: (prompt length, completion pattern: "m" model token, "o" observation token).
ROWS = [
    (3, "mmmoommm"),
    (3, "mmoooom"),
    (4, "mmmmm"),
    (4, "moommmmmmm"),
]
KL_COEF, ENTROPY_COEF, CLIP = 0.1, 0.01, 0.2


def _batch(config, agg):
    """The padded batch (rows 0-1 and 2-3 share a prompt), its per-row sequences and the
    fixed old / reference logprobs and advantages."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, config.vocab_size, size=n).tolist() for n, _ in ROWS[::2]]
    prompt_BP = np.zeros((4, P), np.int32)
    prompt_mask = np.zeros((4, P), bool)
    comp = np.zeros((4, T), np.int32)
    model = np.zeros((4, T), bool)
    obs = np.zeros((4, T), bool)
    rows = []
    for b, (plen, pattern) in enumerate(ROWS):
        prompt = prompts[b // 2]
        prompt_BP[b, P - plen :] = prompt
        prompt_mask[b, P - plen :] = True
        ids = rng.integers(4, config.vocab_size, size=len(pattern))
        comp[b, : len(ids)] = ids
        model[b, : len(pattern)] = [c == "m" for c in pattern]
        obs[b, : len(pattern)] = [c == "o" for c in pattern]
        rows.append((prompt, ids, np.array([c == "m" for c in pattern])))
    old = rng.normal(-3.0, 0.3, size=(4, T)).astype(np.float32)
    ref = rng.normal(-3.0, 0.3, size=(4, T)).astype(np.float32)
    adv = np.array([1.0, -0.5, 0.7, -1.2], np.float32)
    seqs = Sequences(
        prompt_tokens_BP=jnp.asarray(prompt_BP),
        prompt_mask_BP=jnp.asarray(prompt_mask),
        completion_tokens_BT=jnp.asarray(comp),
        completion_mask_BT=jnp.asarray(model),
        observation_mask_BT=jnp.asarray(obs),
    )
    batch = UpdateBatch(
        seqs=seqs,
        advantages=jnp.asarray(adv),
        keep_B=jnp.ones(4, bool),
        old_logp_BT=jnp.asarray(np.where(model, old, 0.0)),
        ref_logp_BT=jnp.asarray(np.where(model, ref, 0.0)),
        layout=RowLayout(2),
    )
    algorithm = rl.AlgorithmConfig(
        agg=agg,
        kl_in="loss",
        kl_coef=KL_COEF,
        entropy_coef=ENTROPY_COEF,
        clip_low=CLIP,
        clip_high=CLIP,
    )
    return batch, algorithm, rows, old, ref, adv


def _row_logprobs(params, config, prompt, ids):
    """(logp, entropy) of each completion token from one forward over prompt ++ completion,
    no mask: the single-turn view where observations are plain context."""
    seq = jnp.asarray(list(prompt) + list(ids), jnp.int32)[None]
    pos = jnp.arange(seq.shape[1], dtype=jnp.int32)[None]
    h, _ = transformer.hidden_states(params, config, seq, pos, jnp.ones(seq.shape, bool))
    logits = unembedding.unembed(params, config, h)[0].astype(jnp.float32)
    logits = logits[len(prompt) - 1 : -1]
    logz = jax.scipy.special.logsumexp(logits, axis=-1)
    logp_all = logits - logz[:, None]
    entropy = -(jnp.exp(logp_all) * logp_all).sum(-1)
    return jnp.take_along_axis(logp_all, jnp.asarray(ids)[:, None], axis=1)[:, 0], entropy


def _expected_loss(params, config, rows, old, ref, adv, agg):
    """The single-turn loss over the model tokens alone, term by term."""
    sums, counts, seqs_n = [], [], 0
    for b, (prompt, ids, model) in enumerate(rows):
        logp, entropy = _row_logprobs(params, config, prompt, ids)
        idx = np.flatnonzero(model)
        logp, entropy = logp[idx], entropy[idx]
        ratio = jnp.exp(logp - old[b, idx])
        pg = jnp.maximum(-adv[b] * ratio, -adv[b] * jnp.clip(ratio, 1 - CLIP, 1 + CLIP))
        d = logp - ref[b, idx]
        kl = jnp.minimum(jnp.exp(-d) + d - 1.0, 10.0)
        tok = pg + KL_COEF * kl - ENTROPY_COEF * entropy
        sums.append(tok.sum() / (len(idx) if agg == "seq-mean-token-mean" else 1.0))
        counts.append(len(idx))
        seqs_n += 1
    total = sum(sums)
    denominator = {
        "token-mean": sum(counts),
        "seq-mean-token-mean": seqs_n,
        "seq-mean-token-sum": seqs_n,
        "seq-mean-token-sum-norm": seqs_n * T,
    }[agg]
    return total / denominator


@pytest.mark.parametrize("agg", AGG_MODES)
def test_two_turn_loss_and_gradient_equal_the_model_tokens_loss(toy_policy, agg):
    config, params = toy_policy
    batch, algorithm, rows, old, ref, adv = _batch(config, agg)
    expected, expected_grads = jax.value_and_grad(_expected_loss)(
        params, config, rows, old, ref, adv, agg
    )
    for num_micro, prompt_group in ((1, 2), (2, 1)):  # shared-prompt path and plain path
        loss, grads, metrics = step.accumulate_gradients(
            params,
            batch,
            model_config=config,
            algorithm=algorithm,
            num_micro=num_micro,
            temperature=1.0,
            prompt_group=prompt_group,
        )
        np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5, atol=1e-6)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    # The entropy metric is over the model tokens too.
    entropy = np.concatenate(
        [np.asarray(_row_logprobs(params, config, p, i)[1])[m] for p, i, m in rows]
    )
    finished = rl.finalize_metrics(metrics)
    assert finished["policy/entropy"] == pytest.approx(float(entropy.mean()), rel=1e-5)


def test_sequences_read_observations_but_lengths_count_them(toy_policy):
    config, _ = toy_policy
    batch, *_ = _batch(config, "token-mean")
    np.testing.assert_array_equal(np.asarray(batch.seqs.lengths_B()), [len(p) for _, p in ROWS])
    cut = batch.trimmed(9)  # row 3 is 10 long: trimmed keeps the observation mask aligned
    assert cut.seqs.observation_mask_BT.shape == (4, 9)


def test_advantages_one_reward_per_trajectory():
    """GRPO: a trajectory's reward (e.g. the sum of its turns' rewards) gives one advantage per
    row; REINFORCE++ with KL-in-reward: the returns count only model tokens' KL, and the
    reward sits at the last model token."""
    model = np.array([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 0, 0]], bool)  # row 1 ends on a model token
    rewards = np.array([2.5, 0.5], np.float32)
    kl = np.arange(12, dtype=np.float32).reshape(2, 6) / 10
    cfg = rl.AlgorithmConfig(
        advantage="reinforce_pp", kl_in="reward", kl_coef=0.5, kl_estimator="k1"
    )
    adv, _, _, _ = rl.compute_advantages_and_returns(
        cfg,
        jnp.asarray(rewards),
        jnp.asarray(rewards > 1),
        jnp.asarray(model),
        1,
        truncated_B=jnp.zeros(2, bool),
        logp_BT=jnp.asarray(kl),
        ref_logp_BT=jnp.zeros((2, 6)),
        valid_B=jnp.ones(2, bool),
    )
    # Returns by hand: r at the last model token, -0.5 * KL on model tokens, summed backwards.
    tok = np.where(model, -0.5 * kl, 0.0)
    tok[0, 5] += 2.5
    tok[1, 3] += 0.5
    ret = np.flip(np.cumsum(np.flip(tok, 1), 1), 1)
    vals = ret[model]
    whitened = (vals - vals.mean()) / (vals.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(np.asarray(adv)[model], whitened, rtol=1e-5, atol=1e-6)
    assert (np.asarray(adv)[~model] == 0).all()
