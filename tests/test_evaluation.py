"""avg@k, unbiased pass@k and maj@k against closed forms and a brute-force estimator."""
import itertools
import math

import numpy as np
import pytest

from jaxrl4llm import evaluation


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 5, 3), (5, 2, 1), (6, 2, 3), (10, 3, 4),
                                   (4, 1, 4)])
def test_pass_at_k_matches_binomial_formula(n, c, k):
    expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_fraction_of_subsets_with_a_correct_sample():
    correct = [True, False, False, True, False, False]
    subsets = list(itertools.combinations(correct, 3))
    brute = np.mean([any(s) for s in subsets])
    assert evaluation.pass_at_k(6, 2, 3) == pytest.approx(brute)


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError, match="0 < k <= n"):
        evaluation.pass_at_k(2, 1, 3)


def test_summarize_table():
    correct = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=bool)
    out = evaluation.summarize(correct, ks=(1, 2), maj_correct_P=np.array([False, True, False]))
    assert out["avg@4"] == pytest.approx(5 / 12)
    assert out["pass@1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert out["pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert out["maj@4"] == pytest.approx(1 / 3)
    assert out["num_prompts"] == 3
    with pytest.raises(ValueError, match="pass@8 needs at least 8"):
        evaluation.summarize(correct, ks=(8,))


def test_majority_answer():
    assert evaluation.majority_answer(["3", "4", "4", None, "3", "4"]) == "4"
    assert evaluation.majority_answer(["3", "4"]) == "3"  # tie: first seen
    assert evaluation.majority_answer([None, ""]) is None


def test_eval_prompts_means_the_first_n_all_or_none(tmp_path):
    """One meaning in trainer and evaluator: N prompts, -1 the whole split, 0 none."""
    from jaxrl4llm.train.config import DataConfig, EvalConfig

    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(7)))
    data = DataConfig(source="synthetic:arithmetic")
    assert evaluation.held_out_records(data, EvalConfig(eval_data=f"jsonl:{path}",
                                                        eval_prompts=0)) == []
    three = evaluation.held_out_records(data, EvalConfig(eval_data=f"jsonl:{path}", eval_prompts=3))
    assert [r.prompt for r in three] == ["q0", "q1", "q2"]
    assert len(evaluation.held_out_records(data, EvalConfig(eval_data=f"jsonl:{path}",
                                                            eval_prompts=-1))) == 7
    assert len(evaluation.held_out_records(data, EvalConfig(eval_data=f"jsonl:{path}",
                                                            eval_prompts=100))) == 7
