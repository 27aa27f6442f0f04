"""tools/bench_partial_pool.py on the toy model: the three ways run the same steps, and the
pool prefills less than the rounds of sampler calls."""

from __future__ import annotations

from jaxrl4llm.models import registry
from tools import bench_partial_pool


def test_the_three_ways_run_the_same_steps(toy_model_dir):
    config, params, tokenizer = registry.load_model(toy_model_dir)
    settings = dict(
        prompts=4, group=2, budget=12, partial_rollout_tokens=3, steps=2, stop=(3, 15),
        messages=lambda record: [{"role": "user", "content": record}],
    )  # fmt: skip
    records = ["copy 1", "copy 2", "copy 3", "copy 1 answer", "copy 2 is", "copy 3 is"] * 8
    report = bench_partial_pool.compare((config, params, tokenizer), records, settings, 0)
    assert report["steps_identical"]
    assert report["compacted_prefilled"] == report["calls_prefilled"] > report["pool_prefilled"]
    assert report["rounds"] > 1 and report["decoded"] > 0 and report["pool_time_ratio"] > 0
