"""--eval_sets: the contract's grammar, registry defaults, metrics by hand, the trainer's
eval/NAME/METRIC and eval/mean/METRIC lines."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl4llm.eval.protocols import set_metrics
from jaxrl4llm.eval.sets import EvalSet, add_means, parse_eval_sets

MINIMALIST = "math500;avg@16;t=1.0,minerva_math;avg@16;t=1.0,olympiadbench;avg@16;t=1.0"
REINFORCE_PP = "aime24;pass@8,amc23;pass@8,math500;pass@1"
KK = ",".join(f"kk{n}=gym:knights_knaves?n_people={n};greedy" for n in range(2, 9))


def test_contract_examples_parse():
    sets = parse_eval_sets(MINIMALIST)
    assert [(s.name, s.source, s.metrics, s.temperature, s.samples) for s in sets] == [
        (n, n, ("avg@16",), 1.0, 16) for n in ("math500", "minerva_math", "olympiadbench")
    ]
    aime, amc, math = parse_eval_sets(REINFORCE_PP)
    assert aime.metrics == ("pass@8",) and aime.samples == 8 and not aime.greedy
    assert math.metrics == ("pass@1",) and math.samples == 1
    assert aime.temperature == 1.0  # the registry protocol's t where the item names none
    kk = parse_eval_sets(KK)
    assert [s.name for s in kk] == [f"kk{n}" for n in range(2, 9)]
    assert kk[6].source == "gym:knights_knaves?n_people=8"
    assert all(s.metrics == ("greedy",) and s.samples == 0 and s.temperature is None for s in kk)


def test_options_and_defaults():
    (s,) = parse_eval_sets(
        "mine=jsonl:/x/{split}.jsonl;greedy;maj@8;avg@4;t=0.6;"
        "max_new_tokens=512;prompts=50;revision=v2"
    )
    assert s == EvalSet(
        "mine", "jsonl:/x/{split}.jsonl", ("greedy", "maj@8", "avg@4"), 0.6, 512, 50, "v2"
    )
    assert s.samples == 8  # the sampled metrics share the largest K
    (bare,) = parse_eval_sets("math500")  # the registry's protocol
    assert bare.metrics == ("avg@16",) and bare.temperature == 1.0
    (run,) = parse_eval_sets("x=gym:gsm_symbolic", eval_samples=4)  # the run's defaults
    assert run.metrics == ("greedy", "avg@4", "pass@4", "maj@4")
    assert parse_eval_sets("") == () and parse_eval_sets(None) == ()


@pytest.mark.parametrize(
    "text,match",
    [
        ("math5000", "not a registered benchmark .* give its data: math5000=SOURCE"),
        ("a=jsonl:x;avg@0", "K must be >= 1"),
        ("a=jsonl:x;top@3", "unknown option 'top@3'"),
        ("a=jsonl:x;t=hot", "'t=hot' is not a valid value"),
        ("a=jsonl:x;prompts=0", "prompts=0 must be >= 1"),
        ("a=jsonl:x,a=jsonl:y", "names a more than once"),
        ("mean=jsonl:x", "not 'mean'"),
        ("a=", "nothing after '='"),
    ],
)
def test_errors_name_the_item(text, match):
    with pytest.raises(ValueError, match=match):
        parse_eval_sets(text)


def test_set_metrics_by_hand():
    correct = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=bool)
    answers = [["5", "6", "6", "5"], ["1", None, "2", "2"], ["3", "3", "4", "4"]]
    out = set_metrics(
        ["greedy", "avg@2", "avg@4", "pass@1", "pass@2", "maj@4", "maj@3"],
        np.array([True, False, False]),
        correct,
        answers,
    )
    assert out["greedy"] == pytest.approx(1 / 3)
    assert out["avg@2"] == pytest.approx(3 / 6)  # first two samples of each prompt
    assert out["avg@4"] == pytest.approx(5 / 12)
    assert out["pass@1"] == pytest.approx((2 / 4 + 0 + 3 / 4) / 3)
    # pass@2 = 1 - C(n-c, 2) / C(4, 2): prompt 1: 1 - 1/6; prompt 2: 0; prompt 3: 1
    assert out["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    # maj@4: "5" (tie with "6", first seen) correct; "2" wrong; "3" (tie, first) correct
    assert out["maj@4"] == pytest.approx(2 / 3)
    # maj@3: "6" wrong; "1" (tie with "2", first seen) wrong; "3" correct
    assert out["maj@3"] == pytest.approx(1 / 3)


def test_means_over_the_sets_that_report_a_metric():
    sets = parse_eval_sets("a=jsonl:x;greedy;pass@8,b=jsonl:y;greedy,c=jsonl:z;pass@8")
    results = {
        "eval/a/greedy": 0.5,
        "eval/a/pass@8": 0.9,
        "eval/b/greedy": 0.25,
        "eval/c/pass@8": 0.3,
    }
    out = add_means(results, sets)
    assert out["eval/mean/greedy"] == pytest.approx(0.375)
    assert out["eval/mean/pass@8"] == pytest.approx(0.6)


def test_trainer_logs_each_set_and_their_mean(toy_model_dir, copy_task_file, tmp_path):
    import jax

    from jaxrl4llm import rl
    from jaxrl4llm.train import loop
    from jaxrl4llm.train.config import TrainConfig
    from jaxrl4llm.train.infra.metrics import read_metrics

    sets = (
        f"one=jsonl:{copy_task_file};greedy;prompts=3,"
        f"two=jsonl:{copy_task_file};greedy;avg@2;pass@2;maj@2;t=1.0;prompts=2"
    )
    config = TrainConfig().replace(
        model=toy_model_dir,
        data=copy_task_file,
        instruction="",
        prompts_per_step=4,
        group_size=2,
        max_prompt_tokens=16,
        max_new_tokens=1,
        algorithm=rl.get_preset("grpo"),
        num_steps=3,
        eval_every=2,
        mesh="data:1,fsdp:1,tensor:1",
        eval_prompts=0,
        eval_sets=sets,
        checkpoint_every=1000,
        workdir=str(tmp_path),
        answer_mode="lenient",
        trackers="",
    )
    summary = loop.run(config, devices=jax.devices()[:1])
    records = read_metrics(str(tmp_path))
    # Evals at 0, every 2 steps, and after the last step (3, not a multiple of eval_every).
    assert [r["step"] for r in records if "eval/one/greedy" in r] == [0, 2, 3]
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # one record per step
    last = records[-1]
    for key in (
        "eval/one/greedy",
        "eval/two/greedy",
        "eval/two/avg@2",
        "eval/two/pass@2",
        "eval/two/maj@2",
        "eval/mean/greedy",
        "eval/two/num_prompts",
    ):
        assert 0 <= last[key] <= 3, key
    assert last["eval/two/num_prompts"] == 2 and last["eval/one/num_prompts"] == 3
    assert last["eval/mean/greedy"] == pytest.approx(
        (last["eval/one/greedy"] + last["eval/two/greedy"]) / 2
    )
    assert last["eval/two/avg@2"] <= last["eval/two/pass@2"]
    assert "eval/accuracy" not in last  # --eval_prompts=0: no single held-out set
    assert summary["eval"]["eval/one/greedy"] == last["eval/one/greedy"]


def test_paper_flagfiles_name_their_data_and_tables():
    import os

    from absl import flags

    from experiments import train
    from jaxrl4llm.data.benchmarks import BENCHMARKS

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def parse(name):
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["train", f"--flagfile={repo}/experiments/configs/{name}.flags"])
        return train.config_from_flags()

    try:
        c = parse("minimalist_qwen25_math_7b_grpo")
        assert c.data.source in BENCHMARKS and c.data.prompt_field is None
        assert [(s.name, s.metrics, s.temperature) for s in c.evaluation.sets] == [
            (n, ("avg@16",), 1.0) for n in ("math500", "minerva_math", "olympiadbench")
        ]
        c = parse("reinforce_pp_knights_knaves")
        assert [s.name for s in c.evaluation.sets] == [f"kk{n}" for n in range(2, 9)]
        # Logic-RL's evaluation: one sample per puzzle at temperature 1.
        assert all(s.metrics == ("pass@1",) and s.temperature == 1.0 for s in c.evaluation.sets)
        pytest.importorskip("reasoning_gym")
        from jaxrl4llm.data import make_source

        train_set = make_source(c.data.source, split="train")
        assert len(train_set) == 4500
        assert len(make_source(c.evaluation.sets[-1].source, split="test")) == 100
    finally:
        flags.FLAGS.unparse_flags()
