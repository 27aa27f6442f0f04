"""tools/plan.py on a tiny model and 8 fake devices: every program compiles from abstract
inputs, its memory is measured and estimated, the update is FSDP-shaped; topologies parse."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import jax
import pytest

from jaxrl4llm import rl
from jaxrl4llm.models import transformer
from jaxrl4llm.models.architectures import ARCHITECTURES
from jaxrl4llm.models.config import TINY
from jaxrl4llm.train.config import TrainConfig

TOOLS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"
)
sys.path.insert(0, TOOLS)
from jaxrl4llm.planner import programs as plan_programs  # noqa: E402
from jaxrl4llm.train.config.checks import validate  # noqa: E402

import plan  # noqa: E402

MODEL = dataclasses.replace(TINY, vocab_size=512, num_layers=3)


def test_topologies_know_their_devices_and_chips():
    assert plan.topology("v5p-64").num_devices == 32  # 2 TensorCores per chip
    assert plan.topology("v5e-256").num_devices == 256
    h100 = plan.topology("8xh100")
    assert h100.num_devices == 8 and h100.chip.hbm_bytes == 80e9
    with pytest.raises(ValueError, match="use v5p-N"):
        plan.topology("tpu-7")
    with pytest.raises(ValueError, match="at most 8 GPUs"):
        plan.topology("16xh100")


def test_architectures_resolve_from_model_paths():
    assert (
        plan_programs.architecture("/models/Qwen2.5-Math-7B/") is ARCHITECTURES["qwen2.5-math-7b"]
    )
    assert round(ARCHITECTURES["qwen3-8b-base"].num_params / 1e9, 2) == 8.19
    with pytest.raises(ValueError, match="ARCHITECTURES"):
        plan_programs.architecture("/models/unknown-13b")


# GRPO (a KL term) on MODEL: 2 mini-batches of 2 micro-batches, 2 rollout chunks, fsdp:8.
TINY_RUN = dict(
    prompts_per_step=8,
    group_size=4,
    max_prompt_tokens=16,
    max_new_tokens=16,
    mini_batch_size=16,
    micro_batch_size=8,
    rollout_micro_batch=16,
    remat=True,
    param_dtype="bfloat16",
    algorithm=rl.get_preset("grpo"),
    mesh="data:1,fsdp:8,tensor:1",
)


def test_plan_of_a_tiny_run_on_eight_devices(capsys):
    config = TrainConfig().replace(**TINY_RUN)
    topo = plan.topology("cpu-8")
    result = plan_programs.plan(config, MODEL, topo, jax.devices()[:8])
    rows = {r.program: r for r in result.rows}
    assert list(rows) == ["create", "rollout", "logprobs", "update"]
    # GRPO with a KL term and 2 mini-batches: reference and old-policy passes, 2 updates.
    assert (rows["logprobs"].calls, rows["update"].calls, rows["rollout"].calls) == (2, 2, 1)
    for r in result.rows:
        assert r.args > 0 and r.total > 0
        assert 0.2 < r.total / r.estimate < 5, (r.program, r.total, r.estimate)
    update = rows["update"].collectives
    assert update["all-gather"] > 0 and update["reduce-scatter"] > 0
    assert 0.5 < result.update_vs_textbook < 2
    assert rows["update"].flops > 0 and rows["update"].t_compute > 0
    # The rollout's matmul FLOPs per device, by hand: each of the 8 batch shards holds one
    # group of 4 rows, all decoding at once (16 / 8 rows, a group at least). At most 16
    # decode steps of 4 rows at the widest table (2 pages: 16 prompt + 16 new tokens), and
    # one prefill of the group's 16 prompt tokens (unembedding its last), counted once
    # though the decode loop holds it; of the loop's decode branches, only the widest.
    d, H, K, Dh, F, V = 64, 4, 2, 16, 128, 512
    layer = 2 * (d * H * Dh * 2 + d * K * Dh * 2 + 3 * d * F)  # per token: q, o, k, v, MLP
    attention = lambda queries, keys: 2 * 2 * H * Dh * queries * keys  # noqa: E731
    decode = 16 * 4 * (3 * (layer + attention(1, 32)) + 2 * d * V)
    prefill = 3 * (16 * layer + attention(16, 16)) + 2 * d * V
    assert rows["rollout"].flops == decode + prefill
    # The sampler gathers the weights once per step (bfloat16, each device receiving 7/8 of
    # every fsdp-sharded weight), none in its decode loop; per token it would be once per
    # prefill and decode step, 2 x 16 of them at the length limit (the paged engine decodes
    # the 32 rows at most --rollout_micro_batch = 16 at once).
    shapes = jax.tree.leaves(transformer.param_shapes(MODEL), is_leaf=lambda x: type(x) is tuple)
    axes = jax.tree.leaves(
        transformer.param_logical_axes(MODEL), is_leaf=lambda x: type(x) is tuple
    )
    sharded = sum(math.prod(s) for s, a in zip(shapes, axes) if "embed" in a)
    rollout = result.rollout
    assert rollout.weight_gathers == pytest.approx(sharded * 2 * 7 / 8)
    assert rollout.in_loop == 0 and rollout.weight_uses == 2 * 16
    once, comm_once = result.rollout_seconds(per_token=False)
    per_token, comm_per_token = result.rollout_seconds(per_token=True)
    assert comm_once == rows["rollout"].t_comm and once == rows["rollout"].seconds
    assert comm_per_token == pytest.approx(
        comm_once + 31 * rollout.weight_gathers / topo.chip.link_bw
    )
    plan.print_plan(result, markdown=True)
    plan.print_slot_use(result, 6, 14)
    plan.print_pool(result, 6, 14, markdown=True)
    out = capsys.readouterr().out
    assert "| update | 2 |" in out and "every program fits" in out
    assert "decode loop: no collective on unchanged values" in out
    assert "32 rows in 16 slots: slot utilisation" in out
    # The flagfile's KV: the default pool of a shard's 16 / 8 rows decoding at once, raised
    # to a group of 4 at full length (page_pool.pool_pages): 1 prompt page + 4 x 2 pages. A
    # fixed batch holds 4 full rows per shard in those 9 pages; the pool admits 24 in all.
    assert "| page pool | 24 | 0.0 (9 pages) |" in out
    assert "| fixed batch | 32 x 1 chunks |" in out


def test_plan_of_a_dapo_run_plans_its_segments():
    """DAPO samples by admission: the rollout row is the segment program, called per segment
    of paged_segments.SEGMENT_STEPS = 32 decode steps: each of the 8 batch shards holds one
    group of 4 rows, all decoding at once, at most 80 steps at full length, so 3 calls. Its
    arguments hold the laid-out weights and the page pool (a group at full length: 1 prompt
    page + 4 x 6 pages of 16 tokens of 2 x 3 layers x 2 kv heads x 16 floats), the state
    donated; the weights' gathers are a program of their own, counted once per step."""
    config = TrainConfig().replace(**{**TINY_RUN, "max_new_tokens": 80})
    config = config.replace(algorithm=rl.get_preset("dapo"))
    result = plan_programs.plan(config, MODEL, plan.topology("cpu-8"), jax.devices()[:8])
    rollout = {r.program: r for r in result.rows}["rollout"]
    assert rollout.calls == 3
    pool = 25 * 16 * 2 * 3 * 2 * 16 * 4  # bytes per device, float32 on the CPU
    assert rollout.args > pool and rollout.alias >= pool
    assert result.rollout.apart and result.rollout.weight_gathers > 0
    once, comm = result.rollout_seconds(per_token=False)
    link = result.topology.chip.link_bw
    assert comm == pytest.approx(3 * rollout.t_comm + result.rollout.weight_gathers / link)


def test_plan_of_a_remax_run_samples_the_greedy_rows_too():
    """ReMax's sampler program has one more row per prompt (greedy), chunked like the sampler's."""
    config = TrainConfig().replace(
        prompts_per_step=8,
        group_size=4,
        max_prompt_tokens=16,
        max_new_tokens=16,
        rollout_micro_batch=16,
        param_dtype="bfloat16",
        algorithm=rl.get_preset("remax"),
        mesh="data:1,fsdp:8,tensor:1",
    )
    result = plan_programs.plan(config, MODEL, plan.topology("cpu-8"), jax.devices()[:8])
    rows = {r.program: r for r in result.rows}
    assert list(rows) == ["create", "rollout", "logprobs", "update"]
    assert rows["rollout"].args > 0 and rows["update"].total > 0


def test_plan_refuses_a_prompt_and_completion_longer_than_the_context():
    """Qwen2.5-Math-7B has 4,096 positions: the REINFORCE++ math flagfile's 1024 + 3072 plan
    past this check, 1024 + 4096 are refused before anything compiles."""
    from absl import flags

    from jaxrl4llm.config.errors import FlagError

    repo = os.path.dirname(TOOLS)
    flagfile = f"--flagfile={repo}/experiments/configs/reinforce_pp_math.flags"
    try:
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["plan", flagfile, "--max_new_tokens=4096", "--topology=cpu-8"])
        with pytest.raises(
            FlagError,
            match=r"1024 \+ --max_new_tokens=4096 = 5120 tokens "
            r"exceed the context of --model=/models/"
            r"Qwen2.5-Math-7B \(4096 positions\)",
        ):
            plan.main([])
    finally:
        flags.FLAGS.unparse_flags()


def test_plan_of_a_ppo_run_plans_the_critic():
    """PPO's critic: its values pass (once per step) and its update (once per mini-batch) are
    planned, and its state (params and two Adam moments of the policy's backbone and a [D]
    head) stays resident beside the sampler, with the policy's moments (and reference)."""
    model = dataclasses.replace(MODEL, num_layers=1, tie_word_embeddings=False)
    config = TrainConfig().replace(
        prompts_per_step=4,
        group_size=4,
        max_prompt_tokens=16,
        max_new_tokens=16,
        mini_batch_size=8,
        micro_batch_size=4,
        param_dtype="float32",
        remat=True,
        algorithm=rl.get_preset("ppo"),
        mesh="data:1,fsdp:2,tensor:1",
    )
    result = plan_programs.plan(config, model, plan.topology("cpu-2"), jax.devices()[:2])
    rows = {r.program: r for r in result.rows}
    assert list(rows) == [
        "create",
        "rollout",
        "logprobs",
        "critic values",
        "update",
        "critic update",
    ]
    assert (rows["critic values"].calls, rows["critic update"].calls) == (1, 2)
    critic_update = rows["critic update"].collectives
    assert critic_update["all-gather"] > 0 and critic_update["reduce-scatter"] > 0
    assert rows["critic update"].flops > 0
    # Per-device float32 elements: weights with a model-width ("embed") axis are split over
    # fsdp:2, the norms are whole; the critic drops the unembedding, adds a [D] head (whole).
    is_tuple = lambda x: type(x) is tuple  # noqa: E731
    shapes = jax.tree.leaves(transformer.param_shapes(model), is_leaf=is_tuple)
    axes = jax.tree.leaves(transformer.param_logical_axes(model), is_leaf=is_tuple)
    policy = sum(math.prod(s) / (2 if "embed" in a else 1) for s, a in zip(shapes, axes))
    D, V = model.hidden_size, model.vocab_size
    critic = policy - V * D / 2 + D
    reference = policy if config.needs_reference else 0
    resident = 4 * (2 * policy + reference + 3 * critic)
    assert rows["rollout"].resident == pytest.approx(resident, abs=64)  # + step counters


def test_plan_refuses_one_host_flags_on_a_multi_host_topology():
    """A v5p host holds 4 chips (v5p-16: 8 chips, 2 hosts); ReMax's greedy baselines are
    picked on one host, so a ReMax run is refused on a pod; DAPO's dynamic sampling runs on
    several hosts (they agree on when to stop resampling), so its flagfile plans there."""
    from absl import flags

    from jaxrl4llm.config.errors import FlagError

    hosts = {
        name: plan.topology(name).num_hosts
        for name in ("v5p-8", "v5p-16", "v5p-64", "v5e-8", "v5e-256", "8xh200", "cpu-8")
    }
    assert hosts == {
        "v5p-8": 1,
        "v5p-16": 2,
        "v5p-64": 8,
        "v5e-8": 1,
        "v5e-256": 64,
        "8xh200": 1,
        "cpu-8": 1,
    }
    remax = TrainConfig().replace(algorithm=rl.get_preset("remax"), mesh="data:1,fsdp:-1,tensor:1")
    validate(remax, 8, num_hosts=1)
    with pytest.raises(FlagError, match="runs on one host only"):  # the run's own check
        validate(remax, 8, num_hosts=2)
    dapo = TrainConfig().replace(algorithm=rl.get_preset("dapo"), mesh="data:1,fsdp:-1,tensor:1")
    assert validate(dapo, 8, num_hosts=2).one_host_only == []
    try:
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["plan", "--algorithm=remax", "--topology=v5p-16"])
        with pytest.raises(
            FlagError,
            match=r"--topology=v5p-16 spans 2 hosts, but "
            r"--advantage=remax pick rows on the host",
        ):
            plan.main([])
    finally:
        flags.FLAGS.unparse_flags()


def test_plan_of_a_lora_run_trains_the_adapters_only():
    """LoRA rank 4 on every projection of MODEL: the optimizer state holds the adapters'
    rank x (in + out) per projection per layer and their two Adam moments (replicated), the
    frozen base is an argument beside it, and with GRPO's KL term no reference copy is kept."""
    is_tuple = lambda x: type(x) is tuple  # noqa: E731
    topo, devices = plan.topology("cpu-8"), jax.devices()[:8]
    full = plan_programs.plan(TrainConfig().replace(**TINY_RUN), MODEL, topo, devices)
    lora = plan_programs.plan(TrainConfig().replace(**TINY_RUN, lora_rank=4), MODEL, topo, devices)
    # MODEL: width 64, 4 query heads and 2 KV heads of 16, MLP 128, 3 layers.
    D, Q, KV, F = 64, 4 * 16, 2 * 16, 128
    in_out = [(D, Q), (D, KV), (D, KV), (Q, D), (D, F), (D, F), (F, D)]  # q k v o gate up down
    adapters = 3 * 4 * sum(i + o for i, o in in_out)
    assert adapters == 3 * 4 * 1024
    assert lora.trained_params == adapters and full.trained_params == MODEL.num_params
    assert "LoRA rank 4 on q,k,v,o,gate,up,down: 0.0M adapter params" in lora.title
    shapes = jax.tree.leaves(transformer.param_shapes(MODEL), is_leaf=is_tuple)
    axes = jax.tree.leaves(transformer.param_logical_axes(MODEL), is_leaf=is_tuple)
    shard = 2 * sum(math.prod(s) / (8 if "embed" in a else 1) for s, a in zip(shapes, axes))
    rows, full_rows = {r.program: r for r in lora.rows}, {r.program: r for r in full.rows}
    # The state `create` writes: adapters and two moments, float32 over the bfloat16 base (+
    # the step, the key and the optimizer's counters: a few hundred bytes).
    assert rows["create"].output == pytest.approx(3 * 4 * adapters, abs=512)
    assert full_rows["create"].output == pytest.approx(3 * shard, abs=512)
    assert rows["create"].resident == pytest.approx(shard)  # the frozen base beside it
    # While sampling: the adapters' moments stay resident; the base and the adapters are
    # the sampler's arguments; no reference copy (full fine-tuning keeps one: `shard`).
    assert rows["rollout"].resident == pytest.approx(2 * 4 * adapters, abs=512)
    assert full_rows["rollout"].resident == pytest.approx(2 * shard + shard, abs=512)
    assert rows["rollout"].args >= shard + 4 * adapters
    # The update donates the adapters' state (aliased outputs), not the base.
    assert rows["update"].alias == pytest.approx(3 * 4 * adapters, abs=512)
    for r in lora.rows:
        assert 0.2 < r.total / r.estimate < 5, (r.program, r.total, r.estimate)


def _plan_of_totals(topo, **totals_gb):
    """A planned step whose programs total `totals_gb` per device (nothing compiled)."""
    from jaxrl4llm.planner.topology import GB

    rows = [
        plan_programs.Row(p, 1, 0.0, 0.0, 0.0, 0.0, gb * GB, gb * GB, {}, 0.0, 0.0, 0.0, 0.0)
        for p, gb in totals_gb.items()
    ]
    rollout = plan_programs.Rollout(32, 32, 16, 0.0, 0.0)
    return plan_programs.Plan("fake", "data:1,fsdp:8,tensor:1", topo, rows, 1.0, rollout, 1)


@pytest.mark.parametrize(
    "totals, code, last_line",
    [
        (dict(create=10.0, rollout=72.0, update=50.0), 0, "decode loop: no collective"),
        (
            dict(create=10.0, rollout=77.1, logprobs=60.0, update=80.0),
            1,
            "DOES NOT FIT 8xh100 (budget 72.0 GB per device): rollout 77.1 GB, update 80.0 GB",
        ),
    ],
)
def test_plan_exits_1_naming_the_programs_that_do_not_fit(
    totals, code, last_line, monkeypatch, capsys
):
    """8 H100s: 72 GB of each 80 GB with 10% headroom. A program over it makes plan.py exit 1
    (through cli.exit_code, as the process does), its last line naming every such program."""
    from absl import flags

    from jaxrl4llm.config import cli

    monkeypatch.setattr(plan.programs, "architecture", lambda name: MODEL)
    monkeypatch.setattr(
        plan.programs, "plan", lambda config, model, topo, devices: _plan_of_totals(topo, **totals)
    )
    monkeypatch.setattr(plan, "print_pool", lambda *args, **kw: None)  # needs a compiled plan
    try:
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["plan", "--topology=8xh100"])
        assert cli.exit_code(plan.main, []) == code
    finally:
        flags.FLAGS.unparse_flags()
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith(last_line)
    assert ("SOME PROGRAM DOES NOT FIT" in out) == bool(code)
