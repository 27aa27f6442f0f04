"""--rollout_engine=paged in the trainer: the same run as the compacted sampler, the
combinations it refuses at validation (exit 2, naming the flag), and --decode_slots as its
alias."""

import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.train import loop
from jaxrl4llm.train.config.checks import validate
from jaxrl4llm.train.infra.metrics import read_metrics

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
    loop.run(plain, devices=_one_device())
    paged = plain.replace(
        workdir=str(tmp_path / "paged"), rollout_engine="paged", kv_cache_tokens=512
    )
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
            dict(rollout_engine="compacted", decode_slots=1, max_turns=3, max_total_tokens=4096),
            r"--decode_slots=1 \(\d+ tokens of KV\) holds less than one multi-turn row",
        ),
        (dict(mesh="data:2,fsdp:1,tensor:1", prompts_per_step=3), "whole groups"),
        (dict(kv_cache_tokens=100), "holds less than one group at full length"),
        (dict(rollout_engine="vllm"), "choose one of compacted, paged"),
        (  # the compacted engine has no pool: the flag would do nothing
            dict(rollout_engine="compacted", kv_cache_tokens=512),
            r"--kv_cache_tokens=512 sizes the paged engine's page pool, which "
            r"--rollout_engine=compacted does not use",
        ),
        (  # the dense multi-turn engine holds every row's cache: the cap is paged only
            dict(rollout_engine="compacted", env="calculator", max_turns=3, rollout_micro_batch=8),
            r"--rollout_micro_batch=8 with --env: .* use --rollout_engine=paged",
        ),
    ],
)
def test_paged_combinations_refused_at_validation(
    overrides, message, toy_model_dir, copy_task_file, tmp_path
):
    base = dict(rollout_engine="paged") if "rollout_engine" not in overrides else {}
    config = _config(toy_model_dir, copy_task_file, tmp_path, **base, **overrides)
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
    loop.run(plain, devices=_one_device())
    paged = plain.replace(
        workdir=str(tmp_path / "paged"),
        rollout_engine="paged",
        kv_cache_tokens=256,
        mesh=mesh,
    )
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


def test_decode_slots_is_an_alias_of_the_paged_engine(toy_model_dir, copy_task_file, tmp_path):
    """--decode_slots=S: the paged engine with the KV S full-length slots held."""
    config = _config(toy_model_dir, copy_task_file, tmp_path, decode_slots=8)
    r = config.rollout
    assert r.paged and r.pool_tokens == 8 * (r.max_prompt_tokens + r.max_new_tokens)
    validate(config, num_devices=1)
    with pytest.raises(FlagError, match=r"--rollout_engine=paged \(--decode_slots\)"):
        validate(
            config.replace(max_turns=3, mesh="data:2,fsdp:1,tensor:1", prompts_per_step=3),
            num_devices=2,
        )


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
        env="calculator", max_turns=2, prompts_per_step=4, group_size=2,
        rollout_engine="paged", mesh=mesh, **pool,
    )  # fmt: skip
    devices = 4 if "tensor:2" in mesh else 2
    validate(config, num_devices=devices)
    loop.run(config, devices=jax.devices()[:devices])
    (record,) = read_metrics(str(tmp_path))
    assert 0 < record["response/length_mean"] <= 12
    if "kv_cache_tokens" in pool:
        assert record["turns/evictions"] > 0  # 4 rows of 2 pages each in 3 pages, per shard
