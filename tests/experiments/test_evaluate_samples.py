"""`python -m experiments.evaluate --samples_out=PATH`: one JSON line per completion, whose
verdicts add up to the metrics of the same run and agree with the reward function re-scoring
the completion text; a path that cannot be written stops the command before the model loads."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl4llm.data.records import Record
from jaxrl4llm.eval.samples import KEYS, SamplesWriter
from jaxrl4llm.rewards import RewardConfig, RewardFn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=REPO,
    XLA_FLAGS="--xla_force_host_platform_device_count=1",
)
PROMPTS, SAMPLES, SET_PROMPTS, SET_SAMPLES, MAX_NEW_TOKENS = 5, 4, 3, 2, 3


def _evaluate(*flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "experiments.evaluate", *flags]
    return subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)


def _majority_correct(lines: list[dict]) -> bool:
    """maj@k by hand: the most frequent answer key (ties: the first seen) and its verdict."""
    keys = [line["answer_key"] for line in lines if line["answer_key"]]
    if not keys:
        return False
    counts = collections.Counter(keys)
    best = next(k for k in keys if counts[k] == max(counts.values()))
    return next(line["correct"] for line in lines if line["answer_key"] == best)


def test_samples_out_writes_every_completion_consistent_with_the_metrics(
    toy_model_dir, copy_task_file, tmp_path
):
    output, samples_out = tmp_path / "eval.json", tmp_path / "new" / "folder" / "samples.jsonl"
    result = _evaluate(
        f"--model={toy_model_dir}",
        f"--data={copy_task_file}",
        "--instruction=",
        f"--max_new_tokens={MAX_NEW_TOKENS}",
        "--max_prompt_tokens=16",
        "--answer_mode=lenient",
        f"--eval_prompts={PROMPTS}",
        f"--eval_samples={SAMPLES}",
        f"--eval_sets=copy={copy_task_file};avg@{SET_SAMPLES};prompts={SET_PROMPTS}",
        "--batch_prompts=2",  # 3 batches: the prompt index runs on across them
        "--mesh=data:1,fsdp:-1,tensor:1",
        f"--output={output}",
        f"--samples_out={samples_out}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(output.read_text())["results"]
    lines = [json.loads(line) for line in samples_out.read_text().splitlines()]
    assert all(tuple(line) == KEYS for line in lines)

    # prompts x (samples + greedy) for --eval_data, prompts x samples for the set (no greedy).
    held_out = [line for line in lines if line["set"] == "eval_data"]
    named = [line for line in lines if line["set"] == "copy"]
    assert len(lines) == PROMPTS * (SAMPLES + 1) + SET_PROMPTS * SET_SAMPLES
    assert sorted((line["prompt_index"], str(line["sample"])) for line in held_out) == sorted(
        (p, s) for p in range(PROMPTS) for s in ["greedy", *map(str, range(SAMPLES))]
    )
    assert sorted((line["prompt_index"], line["sample"]) for line in named) == [
        (p, s) for p in range(SET_PROMPTS) for s in range(SET_SAMPLES)
    ]

    # The record's own fields: the copy file's line i + 1 is "copy D" -> D, D = 1, 2, 3, 1, ...;
    # the prompt is the toy chat template around the user turn (no instruction, no system).
    for line in lines:
        i = line["prompt_index"]
        digit = str(i % 3 + 1)
        assert line["answer"] == digit
        assert line["metadata"] == {"task": "arithmetic", "origin": f"{copy_task_file}:{i + 1}"}
        turn = f"<|im_start|> user copy {digit} <|im_end|> "
        assert line["prompt"] == turn + "<|im_start|> assistant "
        assert 1 <= line["tokens"] <= MAX_NEW_TOKENS
        assert not line["truncated"] or line["tokens"] == MAX_NEW_TOKENS
        assert line["correct"] == (line["status"] == "correct")

    # The verdicts add up to the run's metrics.
    greedy = [line["correct"] for line in held_out if line["sample"] == "greedy"]
    sampled = [line for line in held_out if line["sample"] != "greedy"]
    assert sum(greedy) == pytest.approx(results["accuracy"] * PROMPTS)
    assert np.mean([line["correct"] for line in sampled]) == pytest.approx(
        results[f"avg@{SAMPLES}"]
    )
    assert np.mean([line["correct"] for line in named]) == pytest.approx(
        results[f"copy/avg@{SET_SAMPLES}"]
    )
    by_prompt = collections.defaultdict(list)
    for line in sorted(sampled, key=lambda line: line["sample"]):
        by_prompt[line["prompt_index"]].append(line)
    assert np.mean([_majority_correct(by_prompt[p]) for p in range(PROMPTS)]) == pytest.approx(
        results[f"maj@{SAMPLES}"]
    )
    # The random toy policy gets some right and some wrong, so the sums above can differ.
    assert 0 < sum(line["correct"] for line in lines) < len(lines)

    # The completion texts re-scored by the task's reward function: the same verdicts.
    config = RewardConfig(answer_mode="lenient", max_new_tokens=MAX_NEW_TOKENS)
    records = [Record(f"copy {line['answer']}", line["answer"], line["metadata"]) for line in lines]
    with RewardFn("auto", config) as reward_fn:
        verdicts = reward_fn.score([line["completion"] for line in lines], records)
        keys = reward_fn.answer_keys([line["completion"] for line in lines], records)
    assert verdicts.correct.tolist() == [line["correct"] for line in lines]
    assert verdicts.rewards.tolist() == pytest.approx([line["reward"] for line in lines])
    assert keys == [line["answer_key"] for line in lines]
    assert f"and {samples_out}" in result.stdout


def test_an_unwritable_samples_out_stops_before_the_model_loads(toy_model_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = blocker / "samples.jsonl"  # its folder is a file
    result = _evaluate(f"--model={toy_model_dir}", "--eval_prompts=2", f"--samples_out={path}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"--samples_out={path} cannot be written" in result.stderr
    assert "pass a file path in a folder you can write to" in result.stderr
    assert "Evaluating" not in result.stdout  # printed just before the model loads
    assert "Traceback" not in result.stderr


def test_the_writer_flushes_each_batch_as_it_arrives(tmp_path):
    path = tmp_path / "deep" / "samples.jsonl"
    with SamplesWriter(str(path)) as writer:
        writer([{"set": "a", "metadata": {"n": np.int64(3)}}, {"set": "b", "metadata": {}}])
        # Readable before the evaluation ends: an interrupted one keeps these lines.
        assert [json.loads(line) for line in path.read_text().splitlines()] == [
            {"set": "a", "metadata": {"n": 3}},
            {"set": "b", "metadata": {}},
        ]
        writer([{"set": "c", "metadata": {}}])
    assert len(path.read_text().splitlines()) == 3
