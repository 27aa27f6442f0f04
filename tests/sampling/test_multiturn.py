"""Multi-turn rollouts (sampling/multiturn.py, turn_programs.py) with a fake turn handler:
observations land where the replies put them, the cache stays consistent with a fresh forward
over the whole sequence, a slow tool does not hold the other rows, the limits hold, and a
single turn samples what sampler.generate samples."""

from __future__ import annotations

import dataclasses
import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl4llm import parallel
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models import transformer
from jaxrl4llm.sampling import Sampler, multiturn, sampler, turn_programs
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.strategies import SamplingConfig
from jaxrl4llm.sampling.turns import TurnLimits, TurnReply
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.checks import validate

EOS = (3,)
SAMPLED = SamplingConfig(temperature=1.0, top_k=12)
# Tokens that end a model turn (the toy model emits each often).
TOOL_END = ((10,), (11,), (12, 13))


def _prompts(config, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(7, config.vocab_size, size=n).tolist() for n in lengths]


class FakeHandler:
    """Replies from a worker thread: `observation(row, turn)` tokens, done after `done_after`
    turns; `hold(row)` keeps a row's replies until `release` is set."""

    def __init__(self, stops=TOOL_END, observation=None, done_after=99, hold=None):
        self.stops = stops
        self.observation = observation or (lambda row, turn: [20 + row % 5, 30, 31][: 1 + turn])
        self.done_after = done_after
        self.hold = hold or (lambda row: False)
        self.release = threading.Event()
        self.submits: list[tuple[int, list[int], str]] = []
        self.replies: dict[int, list[TurnReply]] = {}
        self.events: list[tuple[str, int]] = []  # ("submit" | "reply", row), in order
        self._lock = threading.Lock()
        self._ready: queue.Queue = queue.Queue()

    def stop_sequences(self, row):
        return self.stops

    def submit(self, row, turn_ids, ended_by):
        with self._lock:
            turn = sum(1 for r, _, _ in self.submits if r == row)
            self.submits.append((row, list(turn_ids), ended_by))
            self.events.append(("submit", row))
        reply = TurnReply(
            row=row,
            observation_ids=tuple(self.observation(row, turn)),
            done=turn + 1 >= self.done_after,
            reward=1.0 + turn,
            status="error" if turn == 1 else "ok",
            tool_call=ended_by == "stop",
            seconds=0.5,
        )
        threading.Thread(target=self._answer, args=(reply,), daemon=True).start()

    def _answer(self, reply):
        if self.hold(reply.row):
            self.release.wait(timeout=60)
        with self._lock:
            self.events.append(("reply", reply.row))
            self.replies.setdefault(reply.row, []).append(reply)
        self._ready.put(reply)

    def poll(self, timeout_s):
        out = []
        try:
            out.append(
                self._ready.get(timeout=timeout_s) if timeout_s else self._ready.get_nowait()
            )
            while True:
                out.append(self._ready.get_nowait())
        except queue.Empty:
            pass
        return out


def _run(toy_policy, handler, limits, prompts, n=2, budget=24, sampling=SAMPLED, seed=7, **kw):
    config, params = toy_policy
    return multiturn.generate_turns(
        params,
        config,
        prompts,
        sampling,
        budget,
        jax.random.key(seed),
        handler,
        limits,
        stop_ids=EOS,
        n=n,
        pad_id=0,
        **kw,
    )


# One program per row length: compiled without XLA's backend optimizations, which would
# take most of the time of the tests that run it once per row.
_fresh_forward = jax.jit(
    transformer.forward,
    static_argnums=1,
    compiler_options={"xla_backend_optimization_level": 0},
)


def _fresh_logprobs(config, params, prompt, completion, temperature):
    """log_softmax(logits / T) of each completion token, from one uncached forward over
    prompt ++ completion (numpy)."""
    ids = np.asarray(list(prompt) + list(completion), np.int32)[None]
    positions = np.arange(ids.shape[1], dtype=np.int32)[None]
    logits, _ = _fresh_forward(params, config, ids, positions, np.ones_like(ids, bool))
    logits = np.asarray(logits[0], np.float64) / temperature
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    P = len(prompt)
    return np.array([logp[P - 1 + t, tok] for t, tok in enumerate(completion)])


# A sliding window of 4, shorter than every trajectory below (prompt, turns, observations).
WINDOW = 4


@pytest.mark.parametrize("window", [None, WINDOW])
def test_observations_appended_and_cache_matches_a_fresh_forward(toy_policy, window):
    """With a window, the observations prefilled into a row's cache and the decode steps
    after them see only the last W positions, as a fresh forward over the whole row does."""
    config, params = toy_policy
    config = dataclasses.replace(config, sliding_window=window)
    prompts = _prompts(config, (5, 9, 3))
    # With the window, observations longer than it: the model token after one sees only
    # observation tokens.
    longer = lambda row, turn: [20 + row % 5, 30, 31, 24, 25, 26][: 5 + turn]  # noqa: E731
    handler = FakeHandler(done_after=3, observation=None if window is None else longer)
    limits = TurnLimits(max_turns=3, max_observation_tokens=8)
    budget = 24 if window is None else 40  # room for the longer observations
    out, stats = _run((config, params), handler, limits, prompts, budget=budget)
    tokens, mask, obs = (np.asarray(x) for x in (out.tokens_BT, out.mask_BT, out.observation_BT))
    lengths, logp = np.asarray(out.lengths_B), np.asarray(out.logprobs_BT)
    multi = 0
    for r in range(len(prompts) * 2):
        n = int(lengths[r])
        # Rebuild the row from what was submitted and replied: model turn, observation, ...
        turns = [t for row, t, _ in handler.submits if row == r]
        replies = handler.replies[r]
        expect, model = [], []
        for i, turn in enumerate(turns):
            expect += turn
            model += [True] * len(turn)
            if i + 1 < len(turns):  # the last reply's observation is not appended
                # appended whole: one that does not fit ends the trajectory
                observation = list(replies[i].observation_ids)[:8]
                assert len(expect) + len(observation) < budget
                expect += observation
                model += [False] * len(observation)
        assert tokens[r, :n].tolist() == expect
        assert mask[r, :n].tolist() == model and not mask[r, n:].any()
        assert obs[r, :n].tolist() == [not m for m in model] and not obs[r, n:].any()
        assert (logp[r][~mask[r]] == 0).all()
        assert stats.turns_B[r] == len(turns)
        assert stats.reward_B[r] == pytest.approx(sum(x.reward for x in replies))
        assert stats.tool_calls_B[r] == sum(x.tool_call for x in replies)
        assert stats.errors_B[r] == sum(x.status == "error" for x in replies)
        multi += len(turns) > 1
        # The cache after each observation prefill: the sampler's logprobs of every model
        # token (temperature 1) equal a fresh forward's over prompt ++ completion.
        fresh = _fresh_logprobs(config, params, prompts[r // 2], tokens[r, :n], 1.0)
        np.testing.assert_allclose(logp[r, :n][mask[r, :n]], fresh[mask[r, :n]], atol=1e-5)
        if window is not None and len(turns) > 1:
            # The window matters here: without it a fresh forward gives other logprobs for
            # the model tokens after the first observation (longer than the window).
            later = mask[r, :n] & (np.cumsum(obs[r, :n]) > 0)
            assert later.any() and len(replies[0].observation_ids) > window
            unwindowed = dataclasses.replace(config, sliding_window=None)
            fresh = _fresh_logprobs(unwindowed, params, prompts[r // 2], tokens[r, :n], 1.0)
            assert np.abs(fresh - logp[r, :n])[later].max() > 1e-2
    assert multi >= 3, "the toy model should end several turns with a stop sequence"
    assert stats.tools_s == pytest.approx(0.5 * len(handler.submits))


def test_single_turn_samples_what_generate_samples(toy_policy):
    """No stop sequences and a reply that ends the trajectory: the engine's rows are
    sampler.generate's (tokens, masks, lengths; logprobs to float rounding)."""
    config, params = toy_policy
    prompts = _prompts(config, (4, 7, 2, 6), seed=1)
    handler = FakeHandler(stops=(), done_after=1)
    out, stats = _run(toy_policy, handler, TurnLimits(), prompts, n=3, budget=20, seed=5)
    ref = sampler.generate(
        params, config, prompts, SAMPLED, 20, jax.random.key(5), stop_ids=EOS, n=3, pad_id=0
    )
    for field in ("tokens_BT", "mask_BT", "lengths_B", "truncated_B", "prompt_tokens_BP"):
        np.testing.assert_array_equal(
            np.asarray(getattr(out, field)), np.asarray(getattr(ref, field)), err_msg=field
        )
    np.testing.assert_allclose(np.asarray(out.logprobs_BT), np.asarray(ref.logprobs_BT), atol=1e-5)
    assert not np.asarray(out.observation_BT).any()
    assert (stats.turns_B == 1).all() and int(out.num_steps) == int(ref.num_steps)


def test_a_mesh_samples_what_one_device_samples(toy_policy, monkeypatch):
    """On 8 devices (rows over data x fsdp, kv heads over tensor) the trajectories are the
    one-device ones: tokens, masks, observations, lengths, turns and rewards exactly, the
    logprobs to float rounding; rows that took an observation are among them (their
    observation prefilled into a sharded cache row), and a greedy row of each prompt."""
    config, params = toy_policy
    mesh = parallel.make_mesh("data:2,fsdp:2,tensor:2")
    prompts = _prompts(config, (5, 9, 3), seed=6)
    limits = TurnLimits(max_turns=3, max_observation_tokens=8)
    one, one_stats = _run(
        toy_policy, FakeHandler(done_after=3), limits, prompts, n=3, greedy_last=1
    )
    caches = []
    segment = turn_programs.segment

    def watch(weights, s, *args, **kwargs):
        caches.append(s.cache.k_BKHS[0].sharding)
        return segment(weights, s, *args, **kwargs)

    monkeypatch.setattr(turn_programs, "segment", watch)
    smp = Sampler(config, mesh=mesh, stop_ids=EOS, pad_id=0)
    many, many_stats = smp.generate_turns(
        smp.shard_params(params),
        prompts,
        SAMPLED,
        24,
        jax.random.key(7),
        FakeHandler(done_after=3),
        limits,
        RowLayout(3),
        greedy_last=1,
    )
    # The cache the segments decode on: 12 rows (9 padded to a multiple of the data-parallel
    # size 4) split over data x fsdp, the 2 kv heads over tensor.
    assert caches and all(
        c.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), "tensor")), 4) for c in caches
    )
    obs = np.asarray(one.observation_BT)
    assert obs.any(axis=1).sum() >= 2, "some rows should take an observation"
    for field in ("tokens_BT", "mask_BT", "observation_BT", "lengths_B", "truncated_B"):
        np.testing.assert_array_equal(
            np.asarray(getattr(many, field)), np.asarray(getattr(one, field)), err_msg=field
        )
    np.testing.assert_allclose(np.asarray(many.logprobs_BT), np.asarray(one.logprobs_BT), atol=1e-5)
    for field in ("turns_B", "reward_B", "observation_tokens_B", "tool_calls_B"):
        np.testing.assert_array_equal(getattr(many_stats, field), getattr(one_stats, field))


def test_several_hosts_are_refused_naming_why(toy_policy, monkeypatch):
    config, _ = toy_policy
    base = TrainConfig().replace(env="calculator", mesh="data:1,fsdp:-1,tensor:1")
    validate(base, 8, num_hosts=1)
    with pytest.raises(
        FlagError,
        match=r"--env=calculator runs multi-turn rollouts, which run on one host \(this run has 2",
    ):
        validate(base, 8, num_hosts=2)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="same programs in the same order"):
        _run(toy_policy, FakeHandler(), TurnLimits(), _prompts(config, (3,)))


def test_slow_tool_does_not_stall_the_other_rows(toy_policy):
    """Row 0's replies are held until every other row has finished: the others' last turns
    are all submitted before row 0's reply comes (a stalled engine would wait for it first)."""
    config, params = toy_policy
    prompts = _prompts(config, (5, 6, 7), seed=2)
    rows = len(prompts) * 2
    handler = FakeHandler(done_after=2, hold=lambda row: row == 0)
    finals: set[int] = set()
    submit = handler.submit

    def submit_and_watch(row, turn_ids, ended_by):
        submit(row, turn_ids, ended_by)
        if ended_by != "stop" or sum(1 for r, _, _ in handler.submits if r == row) >= 2:
            finals.add(row)
            if finals >= set(range(1, rows)):
                handler.release.set()

    handler.submit = submit_and_watch  # type: ignore[method-assign]
    out, stats = _run(toy_policy, handler, TurnLimits(max_turns=2), prompts, budget=24)
    first_reply_0 = handler.events.index(("reply", 0))
    last_submit_other = max(
        i for i, (what, row) in enumerate(handler.events) if what == "submit" and row != 0
    )
    assert last_submit_other < first_reply_0
    # The other rows did decode past their first turn while row 0 waited.
    assert any(stats.turns_B[r] == 2 for r in range(1, rows))
    assert stats.turns_B[0] >= 1


def test_max_turns_budget_and_observation_cut(toy_policy):
    config, params = toy_policy
    prompts = _prompts(config, (3, 8), seed=3)
    long_obs = lambda row, turn: list(range(14, 24))  # noqa: E731  (10 tokens)
    handler = FakeHandler(observation=long_obs)
    limits = TurnLimits(max_turns=2, max_total_tokens=18, max_observation_tokens=4)
    out, stats = _run(toy_policy, handler, limits, prompts, n=4, budget=99)
    lengths, obs = np.asarray(out.lengths_B), np.asarray(out.observation_BT)
    assert out.tokens_BT.shape[1] == 18 and (lengths <= 18).all()
    for r in range(8):
        submits = [s for s in handler.submits if s[0] == r]
        assert 1 <= len(submits) <= 2 and stats.turns_B[r] == len(submits)
        n_obs = int(obs[r].sum())
        assert n_obs == stats.observation_tokens_B[r]
        first_len, how = len(submits[0][1]), submits[0][2]
        # The observation, cut to 4 tokens, goes on only with room for a model token after it.
        goes_on = how == "stop" and first_len + 4 + 1 <= 18
        assert len(submits) == 1 + goes_on
        if goes_on:
            assert n_obs == 4
            assert np.asarray(out.tokens_BT)[r, first_len : first_len + 4].tolist() == [
                14,
                15,
                16,
                17,
            ]
        else:  # ended by the budget (a long turn, or no room for the observation) or EOS
            assert n_obs == 0 and lengths[r] == first_len
            assert out.truncated_B[r] == (how == "length" or first_len + 4 + 1 > 18)
        if submits[-1][2] == "length":
            assert out.truncated_B[r] and lengths[r] == 18
    assert (stats.turns_B == 2).any(), "some rows should reach the turn limit"


def test_stop_sequence_array_right_aligns():
    a = turn_programs.stop_sequence_array([[(5,), (6, 7, 8)], [], [(9, 9)]])
    assert a.shape == (3, 2, 4)
    assert a[0].tolist() == [[-1, -1, -1, 5], [-1, 6, 7, 8]]
    assert (a[1] == -1).all() and a[2, 0].tolist() == [-1, -1, 9, 9]


def test_stop_sequence_must_lie_in_the_turn():
    """A stop sequence that straddles the observation and the model's turn does not end it."""
    B, N = 1, 8
    s = turn_programs.TurnState(
        cache=None,
        plen_B=jnp.zeros(B, jnp.int32),
        step_B=jnp.array([3], jnp.int32),
        last_B=jnp.zeros(B, jnp.int32),
        live_B=jnp.ones(B, bool),
        keys_B=jnp.zeros(B, jnp.int32),
        cap_B=jnp.full(B, N, jnp.int32),
        turn_start_B=jnp.array([3], jnp.int32),
        ended_B=jnp.zeros(B, jnp.int32),
        tokens_BT=jnp.array([[1, 2, 12, 0, 0, 0, 0, 0]], jnp.int32),
        logprobs_BT=jnp.zeros((B, N)),
        model_BT=jnp.zeros((B, N), bool),
        slot_steps=jnp.int32(0),
    )
    stops = jnp.asarray(turn_programs.stop_sequence_array([[(12, 13)]]))
    eos = jnp.full((8,), -1, jnp.int32)
    after = turn_programs._emit(s, jnp.ones(B, bool), jnp.array([13]), jnp.zeros(B), eos, stops)
    assert int(after.ended_B[0]) == 0 and bool(after.live_B[0])
    inside = turn_programs._emit(
        s.replace(turn_start_B=jnp.array([2], jnp.int32)),
        jnp.ones(B, bool),
        jnp.array([13]),
        jnp.zeros(B),
        eos,
        stops,
    )
    assert int(inside.ended_B[0]) == 1 and not bool(inside.live_B[0])


def test_rounds_take_rewards_and_turn_metrics_from_the_handler(toy_model_dir):
    """sample_and_score with a turn-handler factory: one record per row reaches the factory,
    each row's reward is the sum of its replies' rewards, and the rollout's turn metrics
    count the batch's turns, tool calls and observation tokens."""
    import types

    from jaxrl4llm.models import registry
    from jaxrl4llm.sampling import Sampler
    from jaxrl4llm.sampling.config import RolloutConfig
    from jaxrl4llm.sampling.context import RolloutContext
    from jaxrl4llm.sampling.layout import RowLayout
    from jaxrl4llm.sampling.rounds import sample_and_score
    from jaxrl4llm.train.rollout.stage import _turn_metrics

    config, params, tokenizer = registry.load_model(toy_model_dir)
    made: list = []

    def factory(records):
        made.append(list(records))
        return FakeHandler(done_after=2)

    rollout = RolloutConfig(
        max_new_tokens=16, sampling=SAMPLED, turns=TurnLimits(max_turns=2, max_observation_tokens=3)
    )
    ctx = RolloutContext(
        Sampler(config, tokenizer),
        reward_fn=None,  # type: ignore[arg-type]  (never called with an environment)
        data=types.SimpleNamespace(messages=lambda r: [{"role": "user", "content": r}]),
        rollout=rollout,
        turn_handlers=factory,
    )
    rows, _ = sample_and_score(ctx, params, ["copy 3", "copy 7"], jax.random.key(0), RowLayout(2))
    assert made == [["copy 3", "copy 3", "copy 7", "copy 7"]]
    stats = rows.verdicts.stats
    # Replies give 1 + turn: one turn -> 1, two turns -> 1 + 2.
    np.testing.assert_allclose(
        rows.verdicts.rewards, [1.0 if t == 1 else 3.0 for t in stats.turns_B]
    )
    assert rows.verdicts.correct.all() and not rows.verdicts.failed.any()
    lengths = np.asarray(rows.samples.out.lengths_B)
    m = {k: v.total / v.count for k, v in _turn_metrics(stats, lengths).items()}
    assert m["turns/mean"] == pytest.approx(stats.turns_B.mean())
    assert m["tool/observation_token_share"] == pytest.approx(
        np.asarray(rows.samples.out.observation_BT).sum() / lengths.sum()
    )
    assert m["tool/errors"] == (stats.turns_B == 2).sum()  # the second reply is an "error"
