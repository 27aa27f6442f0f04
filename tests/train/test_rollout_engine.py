"""The trainer's one rollout engine, the paged one: the same run as the compacted sampler
(the tests' reference, tests/compacted_reference.py), the combinations refused at validation
(exit 2, naming the flag), --decode_slots as an alias of its pool, and a config.json naming
the compacted engine resuming on it."""

import json

import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.checks import validate
from jaxrl4llm.train.infra.metrics import read_metrics

from tests.compacted_reference import compacted_rollouts
from tests.train.float_checks import LINEAR_OPT
from tests.train.test_loop import _config, _one_device


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(algorithm=rl.get_preset("remax"), lora_rank=4),
        dict(algorithm=rl.get_preset("dapo"), eval_prompts=8, eval_every=2),
    ],
    ids=["grpo", "remax-greedy-rows-lora", "dapo-dynamic-sampling-eval"],
)
def test_a_paged_run_equals_a_compacted_one(overrides, toy_model_dir, copy_task_file, tmp_path):
    """Two steps with a pool of a few groups (the rows wait for pages): the same rewards and
    losses as the compacted sampler's run (the same samples; LINEAR_OPT as in
    test_loop.test_sharded_run_matches_unsharded), also with ReMax's greedy baseline rows on
    LoRA adapters (folded into the decode weights), and DAPO's dynamic-sampling rounds with
    the evaluation, which samples through the same engine (partial rollouts:
    test_partial.test_a_partial_run_carries_rows_and_counts_them)."""
    kwargs = dict(num_steps=2, max_new_tokens=12, optimizer=LINEAR_OPT, **overrides)
    plain = _config(toy_model_dir, copy_task_file, tmp_path / "compacted", **kwargs)
    with compacted_rollouts():
        loop.run(plain, devices=_one_device())
    paged = plain.replace(workdir=str(tmp_path / "paged"), kv_cache_tokens=512)
    loop.run(paged, devices=_one_device())
    a, b = read_metrics(str(tmp_path / "compacted")), read_metrics(str(tmp_path / "paged"))
    assert len(a) == len(b) >= 2
    for ra, rb in zip(a, b):
        assert {k: v for k, v in ra.items() if k.startswith("eval")} == {
            k: v for k, v in rb.items() if k.startswith("eval")
        }
        if "reward/mean" not in ra:
            continue  # an evaluation record
        assert ra["reward/mean"] == rb["reward/mean"]
        assert ra["response/length_mean"] == rb["response/length_mean"]
        np.testing.assert_allclose(rb["policy/loss"], ra["policy/loss"], rtol=1e-5, atol=1e-6)
        # The engine's counts: at most every row of the step at once (8 prompts x 4, and
        # ReMax's greedy row per group), at most the pool's 32 pages, none for the compacted.
        assert "rollout/rows_per_decode_step" not in ra
        assert 1 <= rb["rollout/rows_per_decode_step"] <= 8 * 5
        assert 1 <= rb["rollout/pages_per_decode_step"] <= 512 // 16
        assert rb["rollout/preemptions"] >= 0
        # DAPO's groups by admission on the paged engine (sampling/admission.py).
        assert ("rollout/groups_admitted" in rb) == ("rollout/rounds" in rb)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(max_turns=3, kv_cache_tokens=16), "less than one multi-turn row at full length"),
        (  # the alias's pool holds max_new_tokens, not the longer turn budget
            dict(decode_slots=1, max_turns=3, max_total_tokens=4096),
            r"--decode_slots=1 \(\d+ tokens of KV\) holds less than one multi-turn row",
        ),
        (dict(kv_cache_tokens=100), "holds less than one group at full length"),
        (dict(rollout_engine="vllm"), "choose one of paged"),
        (  # no longer a trainer engine: the paged one gives its samples
            dict(rollout_engine="compacted"),
            r"--rollout_engine=compacted: the fixed-batch compacted sampler is no longer a "
            r"trainer engine; .* Drop the flag",
        ),
        (  # two ways to size one pool
            dict(decode_slots=2, kv_cache_tokens=512),
            r"--decode_slots=2 is an alias of --kv_cache_tokens .*; set one of them",
        ),
    ],
)
def test_paged_combinations_refused_at_validation(
    overrides, message, toy_model_dir, copy_task_file, tmp_path
):
    config = _config(toy_model_dir, copy_task_file, tmp_path, **overrides)
    with pytest.raises(FlagError, match=message):
        sizes = [int(axis.split(":")[1]) for axis in overrides.get("mesh", "x:1").split(",")]
        validate(config, num_devices=int(np.prod(sizes)))


@pytest.mark.parametrize(
    "overrides,mesh",
    [
        ({}, "data:2,fsdp:1,tensor:1"),
        (dict(algorithm=rl.get_preset("dapo"), max_resample_rounds=2), "data:2,fsdp:1,tensor:1"),
        (
            dict(algorithm=rl.get_preset("dapo"), eval_prompts=8, eval_every=2),
            "data:2,fsdp:1,tensor:2",
        ),
    ],
    ids=["grpo", "dapo-by-admission", "dapo-by-admission-eval-tensor"],
)
def test_a_paged_run_on_a_mesh(overrides, mesh, toy_model_dir, copy_task_file, tmp_path):
    """--rollout_engine=paged on data:2 (one engine and page pool per batch shard,
    sampling/paged_mesh.py; DAPO's groups by admission, sampling/admission.py), and on
    data:2,tensor:2 (each shard's engine splits its heads; the evaluation through the
    one-program engine) validates and runs the one-device compacted run: the same rewards
    and evaluation, the losses within float rounding (LINEAR_OPT: test_loop's sharded
    run)."""
    import jax

    kwargs = dict(num_steps=2, max_new_tokens=12, optimizer=LINEAR_OPT, **overrides)
    plain = _config(toy_model_dir, copy_task_file, tmp_path / "compacted", **kwargs)
    with compacted_rollouts():
        loop.run(plain, devices=_one_device())
    paged = plain.replace(workdir=str(tmp_path / "paged"), kv_cache_tokens=256, mesh=mesh)
    devices = 4 if "tensor:2" in mesh else 2
    validate(paged, num_devices=devices)
    loop.run(paged, devices=jax.devices()[:devices])
    a, b = read_metrics(str(tmp_path / "compacted")), read_metrics(str(tmp_path / "paged"))
    assert len(a) == len(b) >= 2
    evals = lambda records: [  # noqa: E731
        {k: v for k, v in r.items() if k.startswith("eval")}
        for r in records
        if "reward/mean" not in r
    ]
    assert evals(a) == evals(b) and bool(evals(a)) == ("eval_prompts" in overrides)
    for ra, rb in zip(*(([r for r in x if "reward/mean" in r]) for x in (a, b))):
        assert ra["reward/mean"] == rb["reward/mean"]
        assert ra["response/length_mean"] == rb["response/length_mean"]
        np.testing.assert_allclose(rb["policy/loss"], ra["policy/loss"], atol=1e-4)
        # Summed over the two shards' engines: at most every row of the step at once.
        assert 1 <= rb["rollout/rows_per_decode_step"] <= 2 * 8 * 4
        assert ("rollout/groups_admitted" in rb) == bool(overrides)  # DAPO by admission


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(algorithm=rl.get_preset("dapo"), max_resample_rounds=1),
        dict(partial_rollout_tokens=4),
        dict(env="calculator", max_turns=2),
    ],
    ids=["grpo", "dapo-by-admission", "partial", "multi-turn"],
)
def test_prompts_not_a_multiple_of_the_batch_shards(
    overrides, toy_model_dir, copy_task_file, tmp_path
):
    """3 prompts of 2 rows on data:2: each batch shard's engine takes whole groups, so one
    shard gets a spare slot that takes no group (sampler.generate's and multi-turn's rows
    padded to whole groups per shard, the partial-rollout pool's and DAPO admission's slots
    rounded up); the one-device compacted run's rewards and lengths, its losses within float
    rounding."""
    import jax

    kwargs = dict(
        num_steps=2, max_new_tokens=8, optimizer=LINEAR_OPT, prompts_per_step=3, group_size=2,
        **overrides,
    )  # fmt: skip
    plain = _config(toy_model_dir, copy_task_file, tmp_path / "compacted", **kwargs)
    with compacted_rollouts():
        loop.run(plain, devices=_one_device())
    paged = plain.replace(workdir=str(tmp_path / "paged"), mesh="data:2,fsdp:1,tensor:1")
    validate(paged, num_devices=2)
    loop.run(paged, devices=jax.devices()[:2])
    a, b = read_metrics(str(tmp_path / "compacted")), read_metrics(str(tmp_path / "paged"))
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        assert ra["reward/mean"] == rb["reward/mean"]
        assert ra["response/length_mean"] == rb["response/length_mean"]
        np.testing.assert_allclose(rb["policy/loss"], ra["policy/loss"], atol=1e-4)


def test_decode_slots_is_an_alias_of_the_paged_engine(toy_model_dir, copy_task_file, tmp_path):
    """--decode_slots=S: the page pool of the KV S full-length slots held (with
    --kv_cache_tokens too: refused, test_paged_combinations_refused_at_validation)."""
    config = _config(toy_model_dir, copy_task_file, tmp_path, decode_slots=8)
    r = config.rollout
    assert r.pool_tokens == 8 * (r.max_prompt_tokens + r.max_new_tokens)
    validate(config, num_devices=1)


@pytest.mark.parametrize(
    "mesh,pool",
    [("data:2,fsdp:1,tensor:1", dict(kv_cache_tokens=48)),
     ("data:2,fsdp:1,tensor:2", dict(kv_cache_tokens=48)),
     ("data:2,fsdp:1,tensor:1", dict(rollout_micro_batch=4))],
    ids=["data2", "data2-tensor2", "data2-rollout-micro-batch"],
)  # fmt: skip
def test_a_multi_turn_run_on_pages(mesh, pool, toy_model_dir, copy_task_file, tmp_path):
    """--env with --rollout_engine=paged on data:2 (sampling/paged_turns_mesh.py: a pool per
    batch shard), and on data:2,tensor:2 (each shard's heads and pool split over its 2
    devices), with pools of 3 pages (a row at full length: 2) for each shard's 4 rows, or
    with --rollout_micro_batch=4 (2 rows of a shard decoding at once, the default pool
    holding them: 4 pages) validates and runs a step (the samples equal the dense engine's:
    tests/sampling/test_paged_turns.py)."""
    import jax

    config = _config(
        toy_model_dir, copy_task_file, tmp_path, num_steps=1, max_new_tokens=12,
        env="calculator", max_turns=2, prompts_per_step=4, group_size=2, mesh=mesh, **pool,
    )  # fmt: skip
    devices = 4 if "tensor:2" in mesh else 2
    validate(config, num_devices=devices)
    loop.run(config, devices=jax.devices()[:devices])
    (record,) = read_metrics(str(tmp_path))
    assert 0 < record["response/length_mean"] <= 12
    if "kv_cache_tokens" in pool:
        assert record["turns/evictions"] > 0  # 4 rows of 2 pages each in 3 pages, per shard


def test_a_config_json_naming_the_compacted_engine_runs_on_pages(
    toy_model_dir, copy_task_file, tmp_path
):
    """A run's config.json written when the compacted sampler was a trainer engine loads
    with the paged engine (the same samples), so that the run resumes and its checkpoints
    evaluate; a fresh config runs on pages too."""
    config = _config(toy_model_dir, copy_task_file, tmp_path)
    assert config.rollout.rollout_engine == "paged" and config.rollout.pool_tokens == 0
    written = json.loads(config.to_json())
    written["rollout"]["rollout_engine"] = "compacted"
    loaded = TrainConfig.from_json(json.dumps(written))
    assert loaded == config
    validate(loaded, num_devices=1)
