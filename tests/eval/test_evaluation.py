"""avg@k, unbiased pass@k and maj@k against closed forms and a brute-force estimator; the
held-out prompts the evaluator takes."""

import itertools
import math

import numpy as np
import pytest

from jaxrl4llm.eval import evaluator, protocols


@pytest.mark.parametrize(
    "n,c,k", [(5, 0, 1), (5, 5, 3), (5, 2, 1), (6, 2, 3), (10, 3, 4), (4, 1, 4)]
)
def test_pass_at_k_matches_binomial_formula(n, c, k):
    expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert protocols.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_fraction_of_subsets_with_a_correct_sample():
    correct = [True, False, False, True, False, False]
    subsets = list(itertools.combinations(correct, 3))
    brute = np.mean([any(s) for s in subsets])
    assert protocols.pass_at_k(6, 2, 3) == pytest.approx(brute)


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError, match="0 < k <= n"):
        protocols.pass_at_k(2, 1, 3)


def test_summarize_table():
    correct = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=bool)
    out = protocols.summarize(correct, ks=(1, 2), maj_correct_P=np.array([False, True, False]))
    assert out["avg@4"] == pytest.approx(5 / 12)
    assert out["pass@1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert out["pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert out["maj@4"] == pytest.approx(1 / 3)
    assert out["num_prompts"] == 3
    with pytest.raises(ValueError, match="pass@8 needs at least 8"):
        protocols.summarize(correct, ks=(8,))


def test_majority_answer():
    assert protocols.majority_answer(["3", "4", "4", None, "3", "4"]) == "4"
    assert protocols.majority_answer(["3", "4"]) == "3"  # tie: first seen
    assert protocols.majority_answer([None, ""]) is None


def test_eval_prompts_means_the_first_n_all_or_none(tmp_path):
    """One meaning in trainer and evaluator: N prompts, -1 the whole split, 0 none."""
    from jaxrl4llm.data.config import DataConfig
    from jaxrl4llm.eval.config import EvalConfig

    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(7)))
    data = DataConfig(source="synthetic:arithmetic")
    assert (
        evaluator.held_out_records(data, EvalConfig(eval_data=f"jsonl:{path}", eval_prompts=0))
        == []
    )
    three = evaluator.held_out_records(data, EvalConfig(eval_data=f"jsonl:{path}", eval_prompts=3))
    assert [r.prompt for r in three] == ["q0", "q1", "q2"]
    assert (
        len(
            evaluator.held_out_records(data, EvalConfig(eval_data=f"jsonl:{path}", eval_prompts=-1))
        )
        == 7
    )
    assert (
        len(
            evaluator.held_out_records(
                data, EvalConfig(eval_data=f"jsonl:{path}", eval_prompts=100)
            )
        )
        == 7
    )


def test_draw_and_evaluate_score_each_batch_through_the_trainers_sampling_path():
    """Greedy and K = 2 sampled completions of 3 records in batches of 2, drawn by
    sampling.rounds.sample_and_score (the fake sampler's row r:g is record r's sample g) and
    scored by the context's reward function; the metrics by hand."""
    import types

    import jax

    from jaxrl4llm.sampling import GREEDY

    from tests.sampling.test_rounds import FakeSampler, FakeVerifier

    class Sampler(FakeSampler):
        """Also records each call's sampling strategy."""

        def __init__(self):
            super().__init__(widths=(4,))
            self.strategies = []

        def sample(self, params, messages, sampling, *args, **kwargs):
            self.strategies.append(sampling)
            return super().sample(params, messages, sampling, *args, **kwargs)

    class Verifier(FakeVerifier):
        def answer_keys(self, texts, records):
            return [ANSWERS[r][int(t.split(":")[1])] for t, r in zip(texts, records)]

    VERDICTS = {0: [True, False], 1: [False, False], 2: [True, True]}
    ANSWERS = {0: ["5", "6"], 1: ["1", None], 2: ["3", "3"]}
    sampler = Sampler()
    sampled = object()  # the rollout's sampling config, passed through untouched
    ctx = types.SimpleNamespace(
        sampler=sampler,
        reward_fn=Verifier(VERDICTS),
        data=types.SimpleNamespace(messages=lambda r: r),
        rollout=types.SimpleNamespace(sampling=sampled, max_new_tokens=3, share_prompts=True),
        turn_handlers=None,
    )
    drawn = evaluator.draw(
        ctx, None, [0, 1, 2], greedy=True, samples=2, key=jax.random.key(0), prompts_per_batch=2
    )
    assert [(c[0], c[1]) for c in sampler.calls] == [([0, 1], 1), ([0, 1], 2), ([2], 1), ([2], 2)]
    assert sampler.strategies == [GREEDY, sampled, GREEDY, sampled]
    np.testing.assert_array_equal(drawn.greedy_P, [True, False, True])  # sample 0's verdict
    np.testing.assert_array_equal(drawn.correct_PK, [[True, False], [False, False], [True, True]])
    assert drawn.answers_PK == [["5", "6"], ["1", None], ["3", "3"]]

    out = evaluator.evaluate(
        ctx, None, [0, 1, 2], samples=2, key=jax.random.key(0), prompts_per_batch=2, prefix=""
    )
    # pass@1 = mean c / n; pass@2 = any correct; maj@2: "5" (tie, first seen) right, "1"
    # wrong, "3" right.
    assert out == pytest.approx(
        {
            "accuracy": 2 / 3,
            "avg@2": 3 / 6,
            "pass@1": (1 / 2 + 0 + 1) / 3,
            "pass@2": 2 / 3,
            "maj@2": 2 / 3,
            "num_prompts": 3.0,
        }
    )
