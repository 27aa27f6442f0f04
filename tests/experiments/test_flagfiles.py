"""Flags come from the config tree: every shipped flagfile parses to the config the old code
gave (but for issue 14's deliberate changes), to the values of its table in docs/algorithms.md
("Paper settings"), config.json round-trips (old flat files too), and a new field is a new flag."""

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

import pytest
from absl import flags

from experiments import train
from jaxrl4llm import rl
from jaxrl4llm.config import cli, options
from jaxrl4llm.train.config import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGFILES = sorted(glob.glob(os.path.join(REPO, "experiments", "configs", "*.flags")))
# Resolved configs of the code before the config tree (commit 7d1c79a): `config_from_flags()`
# of each flagfile (and of two extra argument lists), as its config.json.
OLD = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "old_configs", "*.json")))
# Knobs added since, with the value that reproduces the old code.
ADDED = {
    "k3_clamp": None,
    "log_kl_ref": False,
    "rejected_rows": "drop",
    "importance": "token",
    "dynamic_sampling": False,
    "max_resample_rounds": 10,  # issue 18
    "gamma": 1.0,
    "lam": 0.95,
    "value_clip": 0.2,  # issue 18: PPO's GAE and value clip
    # the sampler-trainer gap's correction, off by default
    "is_correction": None,
    "is_level": "token",
    "is_cap": 2.0,
    "is_lower": 0.5,
    "is_upper": 2.0,
}
# Deliberate changes since, as (old, new) by key of the old config.json ("optimizer.x" for the
# optimizer's). Everywhere: k3 is capped at 10 (issue 14).
CHANGED_EVERYWHERE = {"k3_clamp": (None, 10.0)}
# Issue 14: the Minimalist flagfiles follow the authors' scripts (docs/algorithms.md).
_MINIMALIST = {
    "dual_clip": (None, 3.0),
    "entropy_coef": (0.0, 0.001),
    "optimizer.weight_decay": (0.0, 0.01),
    "mini_batch_size": (512, 1024),
    "num_steps": (500, 444),
    "long_prompts": ("error", "drop"),
    "system_prompt": (
        None,
        "Please reason step by step, and put your final answer within \\boxed{}.",
    ),
    "instruction": (None, "Let's think step by step and output the final answer within \\boxed{}."),
}
# Issue 38: every paper flagfile keeps float32 master weights (with bfloat16 matmuls,
# --compute_dtype, a flag the old code did not have).
_MASTER = {"param_dtype": ("bfloat16", "float32")}
FIXED = {
    # The old parser dropped a knob set to none (`--kl_in=none` kept the preset's "loss"; with
    # --kl_coef=0 nothing used it, so training was the same). The quickstart keeps one
    # checkpoint (each is about 1.4 GB: a laptop's disk).
    "quickstart": {"kl_in": ("loss", None), "keep_checkpoints": (3, 1)},
    "minimalist_qwen25_math_7b_grpo": dict(
        _MINIMALIST, **_MASTER, agg=("seq-mean-token-mean", "token-mean"), kl_coef=(0.04, 0.001)
    ),
    "minimalist_qwen25_math_7b_raft_pp": dict(
        _MINIMALIST,
        **_MASTER,
        kl_in=(None, "loss"),
        kl_coef=(0.0, 0.001),
        rejected_rows=("drop", "zero"),
    ),
    "minimalist_qwen25_math_7b_reinforce_rej": dict(
        _MINIMALIST,
        **_MASTER,
        kl_in=(None, "loss"),
        kl_coef=(0.0, 0.001),
        rejected_rows=("drop", "zero"),
    ),
}
# The paper flagfiles name their data by registry names and gym tasks (issue 16) instead of
# /data/... paths: flag -> (the old value, today's).
_NUMINA = {
    "data": ("parquet:/data/numinamath/{split}.parquet", "numina_math"),
    "prompt_field": ("problem", None),
    "answer_field": ("solution", None),
    "eval_data": (None, "math500"),
}
DATA_BY_NAME = {
    **{f"minimalist_qwen25_math_7b_{a}": _NUMINA for a in ("grpo", "raft_pp", "reinforce_rej")},
    "reinforce_pp_knights_knaves": {
        "data": (
            "synthetic:knights_knaves?min_people=3&max_people=7&n=5000",
            "gym:knights_knaves?n_people=3..7&n=4500",
        ),
        "eval_data": (
            "synthetic:knights_knaves?min_people=8&max_people=8&n=200",
            "gym:knights_knaves?n_people=8&n=100",
        ),
        # Logic-RL's prompt and format reward (issue 14).
        "system_prompt": (None, "@logic_rl"),
        "reward_scale": ("01", "logic_rl"),
        # One sample per puzzle at temperature 1, as Logic-RL evaluates (issue 38).
        "eval_samples": (4, 1),
        **_MASTER,
    },
    "tricks_or_traps_qwen3_8b_lite_ppo": {
        "data": ("parquet:/data/math/{split}.parquet", "dapo_math_17k"),
        "eval_data": (None, "math500"),
        **_MASTER,
    },
}
DATA_BY_NAME["overrides"] = DATA_BY_NAME["tricks_or_traps_qwen3_8b_lite_ppo"]  # its flagfile
# Micro-batches re-planned for the pod (issue 12, docs/scaling.md): flag -> (old, today's).
# Gradient accumulation sums to the same mini-batch gradient, so training is unchanged.
PLANNED = {
    **{
        f"minimalist_qwen25_math_7b_{a}": {"micro_batch_size": (64, 128)}
        for a in ("grpo", "raft_pp", "reinforce_rej")
    },
    "tricks_or_traps_qwen3_8b_lite_ppo": {"micro_batch_size": (16, 64)},
    "overrides": {"micro_batch_size": (16, 64)},
}


@pytest.fixture
def parsed():
    def parse(*argv):
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["train", *argv])
        return train.config_from_flags()

    yield parse
    flags.FLAGS.unparse_flags()


def _old(path):
    with open(path) as f:
        fixture = json.load(f)
    return fixture["argv"], fixture["config"]


def test_there_are_flagfiles():
    names = {os.path.basename(f) for f in FLAGFILES}
    assert "quickstart.flags" in names and len(names) >= 19
    # Every flagfile of the old code is still here.
    assert {os.path.basename(f)[: -len(".json")] for f in OLD} - {"defaults", "overrides"} <= {
        n[: -len(".flags")] for n in names
    }


@pytest.mark.parametrize("path", FLAGFILES, ids=os.path.basename)
def test_flagfile_gives_a_valid_config(path, parsed):
    config = parsed(f"--flagfile={path}")
    config.validate(num_devices=8)  # one 8-accelerator host
    assert config.algorithm.name == flags.FLAGS.algorithm


@pytest.mark.parametrize("path", OLD, ids=os.path.basename)
def test_flags_parse_to_the_config_of_the_old_code(path, parsed, monkeypatch):
    """Field by field: each old flat key is today's flag of the same name; the old nested
    algorithm / optimizer dicts are today's sub-configs."""
    monkeypatch.chdir(REPO)
    argv, old = _old(path)
    config = parsed(*argv)
    fixture = os.path.basename(path)[: -len(".json")]
    fixed = {
        **CHANGED_EVERYWHERE,
        **FIXED.get(fixture, {}),
        **DATA_BY_NAME.get(fixture, {}),
        **PLANNED.get(fixture, {}),
    }
    old = dict(old)
    want = {
        "algorithm": dict(ADDED, **old.pop("algorithm")),
        "optimizer": old.pop("optimizer"),
        "": old,
    }
    for key, (before, after) in fixed.items():
        part, _, name = key.rpartition(".")
        part = part or ("algorithm" if name in want["algorithm"] else "")
        assert want[part][name] == before, key
        want[part][name] = after
    got_algorithm = dataclasses.asdict(config.algorithm)
    got_algorithm["binary_reward"] = (
        list(got_algorithm["binary_reward"]) if got_algorithm["binary_reward"] else None
    )
    assert got_algorithm == want["algorithm"]
    assert dataclasses.asdict(config.optimizer) == want["optimizer"]
    flat = options.flatten(config)
    for key, value in old.items():
        assert flat[key] == value, key
    # Spot checks through the tree, by hand.
    assert config.rollout.group_size == old["group_size"]
    assert config.model.name == old["model"] and config.data.source == old["data"]
    assert config.reward.scale == old["reward_scale"]
    assert config.reward.num_workers == old["reward_workers"]
    assert config.reward.max_new_tokens == old["max_new_tokens"]


@pytest.mark.parametrize("path", OLD, ids=os.path.basename)
def test_old_flat_config_json_still_loads(path):
    _, old = _old(path)
    config = TrainConfig.from_json(json.dumps(old))
    assert config.run.num_steps == old["num_steps"]
    assert config.rollout.sampling.temperature == old["temperature"]
    assert config.optimizer.schedule == old["optimizer"]["schedule"]
    assert config.algorithm.kl_in == old["algorithm"]["kl_in"]
    binary = old["algorithm"]["binary_reward"]
    assert config.algorithm.binary_reward == (tuple(binary) if binary else None)
    assert TrainConfig.from_json(config.to_json()) == config


def test_config_json_round_trips_the_tree(parsed):
    config = parsed(
        f"--flagfile={REPO}/experiments/configs/tricks_or_traps_qwen3_8b_lite_ppo.flags",
        "--binary_reward=-1,1",
        "--overlong_buffer=64",
        "--top_k=5",
    )
    data = json.loads(config.to_json())
    assert data["rollout"]["sampling"]["top_k"] == 5
    assert data["algorithm"]["binary_reward"] == [-1.0, 1.0]
    assert data["reward"]["max_new_tokens"] == 8192  # follows --max_new_tokens
    assert TrainConfig.from_json(config.to_json()) == config


def test_paper_hyperparameters(parsed):
    c = parsed(f"--flagfile={REPO}/experiments/configs/reinforce_pp_knights_knaves.flags")
    assert (c.rollout.prompts_per_step, c.rollout.group_size, c.optimizer.learning_rate) == (
        32,
        8,
        5e-7,
    )
    assert (c.algorithm.kl_coef, c.algorithm.kl_in, c.algorithm.clip_low) == (0.001, "reward", 0.2)
    c = parsed(f"--flagfile={REPO}/experiments/configs/minimalist_qwen25_math_7b_raft_pp.flags")
    # 256 prompts per mini-batch (verl counts prompts) = 1024 rows: 4 updates per rollout.
    assert (c.rollout.prompts_per_step, c.rollout.group_size, c.mini_batch) == (1024, 4, 1024)
    assert c.updates_per_step == 4
    assert c.algorithm.name == "raft_pp"
    assert c.rollout.max_prompt_tokens + c.rollout.max_new_tokens == 4096


def test_command_line_overrides_the_flagfile(parsed):
    c = parsed(
        f"--flagfile={REPO}/experiments/configs/tricks_or_traps_qwen3_8b_lite_ppo.flags",
        "--clip_high=0.28",
        "--agg=seq-mean-token-mean",
        "--binary_reward=-1,1",
    )
    assert c.algorithm.clip_high == 0.28 and c.algorithm.agg == "seq-mean-token-mean"
    assert c.algorithm.std == "batch"  # the preset's value stays where not overridden
    assert c.algorithm.binary_reward == (-1.0, 1.0)


def test_preset_knobs_override_only_when_given(parsed):
    c = parsed("--algorithm=reinforce_pp")
    assert (c.algorithm.kl_in, c.algorithm.kl_estimator, c.algorithm.kl_coef) == (
        "reward",
        "k1",
        0.01,
    )
    c = parsed("--algorithm=grpo", "--kl_in=none", "--kl_coef=0", "--noreject_all_wrong")
    assert c.algorithm.kl_in is None and c.algorithm.kl_coef == 0.0 and not c.needs_reference
    # The KL as a metric only: the reference is loaded, the loss has no KL term.
    c = parsed("--algorithm=raft_pp", "--log_kl_ref")
    assert c.needs_reference and c.algorithm.kl_in is None and c.algorithm.log_kl_ref
    c = parsed("--algorithm=reinforce_rej", "--rejected_rows=drop", "--k3_clamp=none")
    assert (c.algorithm.rejected_rows, c.algorithm.k3_clamp) == ("drop", None)
    with pytest.raises(flags.IllegalFlagValueError, match="choose one of drop|zero"):
        parsed("--rejected_rows=keep")
    c = parsed("--algorithm=reinforce_rej", "--reject_all_wrong=false")
    assert (c.algorithm.reject_all_correct, c.algorithm.reject_all_wrong) == (True, False)


def test_reward_and_optimizer_options_are_flags(parsed):
    c = parsed(
        "--overlong_penalty=0.5",
        "--countdown_use_all",
        "--item_timeout_s=2.5",
        "--batch_timeout_s=30",
        "--reward_scale=pm1",
        "--reward_workers=3",
        "--max_new_tokens=99",
        "--lr_schedule=cosine",
        "--adam_b2=0.95",
        "--adam_eps=1e-5",
        "--eps=1e-4",
        "--nodistributed",
    )
    r = c.reward
    assert (r.overlong_penalty, r.countdown_use_all, r.item_timeout_s, r.batch_timeout_s) == (
        0.5,
        True,
        2.5,
        30.0,
    )
    assert (r.scale, r.num_workers, r.max_new_tokens) == ("pm1", 3, 99)
    assert (c.optimizer.schedule, c.optimizer.b2, c.optimizer.eps) == ("cosine", 0.95, 1e-5)
    assert c.algorithm.eps == 1e-4  # --eps is the advantage's; Adam's is --adam_eps
    with pytest.raises(flags.IllegalFlagValueError, match="choose one of constant"):
        parsed("--lr_schedule=exp")
    with pytest.raises(flags.IllegalFlagValueError, match="'wide' is not a valid float"):
        parsed("--clip_high=wide")


def test_every_option_has_help_and_a_unique_flag():
    for o in options.options(TrainConfig):
        assert o.help != f"{o.group_class}.{o.path[-1]}", f"--{o.name} has no docstring line"
        assert flags.FLAGS[o.name].help.startswith(o.help)


def test_a_new_field_is_a_new_flag():
    @dataclasses.dataclass(frozen=True)
    class Inner:
        """A sub-config.

        knob: How much.
        mode: Which way.
        """

        knob: int = 3
        mode: str = "a"

    @dataclasses.dataclass(frozen=True)
    class Root:
        inner: Inner = options.group(
            Inner, flags={"knob": "inner_knob"}, choices={"mode": ("a", "b")}
        )

    values = flags.FlagValues()
    cli.define_flags(Root, values)
    values(["prog", "--inner_knob=5", "--mode=b"])
    assert cli.config_from_flags(Root, values) == Root(Inner(knob=5, mode="b"))
    assert values["inner_knob"].help == "How much."
    assert values.find_module_defining_flag("mode") == "inner (Inner)"
    with pytest.raises(flags.IllegalFlagValueError):
        values(["prog", "--mode=c"])


def test_helpfull_groups_flags_by_sub_config():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--helpfull"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    sections = {}
    for block in result.stdout.split("\n\n"):
        head, _, body = block.strip().partition(":\n")
        sections[head] = body
    assert "--group_size" in sections["rollout (RolloutConfig)"]
    assert "--temperature" in sections["rollout.sampling (SamplingConfig)"]
    assert "--lr_schedule" in sections["optimizer (OptimizerConfig)"]
    assert "--overlong_penalty" in sections["reward (RewardConfig)"]
    assert "--clip_high" in sections["algorithm (AlgorithmConfig)"]
    assert "--model" in sections["model (ModelOptions)"]


# ---- docs/algorithms.md "Paper settings": one source of truth for presets and flagfiles ----

DOCS = os.path.join(REPO, "docs", "algorithms.md")
PAPER_FLAGFILES = sorted(
    os.path.basename(f)
    for f in FLAGFILES
    if not f.endswith("quickstart.flags") and not os.path.basename(f).startswith("quickstart")
)


def _paper_settings():
    """{("preset", name) or ("flagfile", file): [(flag, value text or None), ...]} from the
    tables of the docs' "Paper settings" section (`--flag=value`, `--flag`, `--noflag` spans
    in the middle column; a table applies to the preset of its heading or to the files of
    the "Flagfiles:" paragraph above it)."""
    with open(DOCS) as f:
        section = f.read().split("\n## Paper settings\n", 1)[1].split("\n## ", 1)[0]
    settings, targets, files_paragraph = {}, [], None
    for line in section.splitlines() + [""]:
        if files_paragraph is not None:
            if line.strip():
                files_paragraph += " " + line
                continue
            targets = [("flagfile", n) for n in re.findall(r"`([\w.]+\.flags)`", files_paragraph)]
            files_paragraph = None
        if line.startswith("#"):
            preset = re.match(r"#+ Preset `(\w+)`", line)
            targets = [("preset", preset.group(1))] if preset else []
        elif line.startswith("Flagfiles:"):
            files_paragraph = line
        elif line.startswith("|") and not line.startswith(("|---", "| paper setting")):
            middle = line.strip().strip("|").split("|")[1]
            spans = re.findall(r"`(--[^`]+)`", middle)
            assert targets or not spans, f"a table row with flags but no preset / flagfiles: {line}"
            for span in spans:
                name, _, value = span[2:].partition("=")
                for target in targets:
                    settings.setdefault(target, []).append((name, value if "=" in span else None))
    return settings


def _expected(name, value):
    option = options.option_map(TrainConfig)
    if value is None:  # --flag / --noflag
        if name in option:
            return name, True
        assert name.startswith("no") and name[2:] in option, f"--{name} is not a flag"
        return name[2:], False
    assert name in option, f"--{name} is not a flag"
    return name, options.parse_text(option[name], value)


def _check(flat, rows, where):
    assert rows, f"{where} has no flags in its docs table"
    for name, value in rows:
        key, want = _expected(name, value)
        assert flat[key] == want, (
            f"{where}: --{key} is {flat[key]!r}, docs/algorithms.md says {want!r}"
        )


def test_every_preset_and_paper_flagfile_has_a_docs_table():
    settings = _paper_settings()
    assert {n for kind, n in settings if kind == "preset"} == set(rl.PRESETS), (
        "every preset needs a '### Preset `name`' table under 'Paper settings' in "
        "docs/algorithms.md"
    )
    assert {n for kind, n in settings if kind == "flagfile"} == set(PAPER_FLAGFILES)


@pytest.mark.parametrize("name", sorted(rl.PRESETS))
def test_preset_matches_its_docs_table(name):
    _check(
        options.flatten(TrainConfig().replace(algorithm=name)),
        _paper_settings()[("preset", name)],
        f"preset {name}",
    )


@pytest.mark.parametrize("name", PAPER_FLAGFILES)
def test_paper_flagfile_matches_its_docs_tables(name, parsed):
    config = parsed(f"--flagfile={REPO}/experiments/configs/{name}")
    _check(options.flatten(config), _paper_settings()[("flagfile", name)], name)


# The --eval_sets syntax of the data/eval contract (one ITEM = NAME[=SOURCE][;OPT...]).
_EVAL_OPT = r"(greedy|(avg|pass|maj)@\d+|t=[0-9.]+|max_new_tokens=\d+|prompts=\d+)"
_EVAL_ITEM = rf"\w+(=[^,;]+)?(;{_EVAL_OPT})*"


_MINIMALIST_SETS = ("math500", "minerva_math", "olympiadbench")
# What each paper evaluates (its table), by the flagfile's family.
PAPER_EVAL_SETS = {
    # Qwen2.5-Math-7B's 4,096-token context leaves 3,072 tokens to generate after a prompt of
    # 1,024; LLaMA's evaluation generates the paper's 4,096.
    "minimalist_qwen25": ",".join(f"{n};avg@16;t=1.0" for n in _MINIMALIST_SETS),
    "minimalist_llama32": ",".join(
        f"{n};avg@16;t=1.0;max_new_tokens=4096" for n in _MINIMALIST_SETS
    ),
    "reinforce_pp_math": "aime24;pass@8,amc23;pass@8,math500;pass@1",
    # Six maths benchmarks (the summaries do not name them: the project's six), 8 samples.
    "tricks_or_traps": ",".join(
        f"{n};avg@8;t=1.0"
        for n in ("math500", "olympiadbench", "minerva_math", "aime24", "aime25", "amc23")
    ),
    "reinforce_pp_aime24": "aime25;pass@1;pass@16;t=1.0,aime24;pass@1;t=1.0",
    # ToRL's Table 1 (the README's tables): five sets, one answer each.
    "torl": ",".join(
        f"{n};greedy" for n in ("aime24", "aime25", "math500", "olympiadbench", "amc23")
    ),
    # Per number of people (the paper's Figure 4), sampled at T = 1 as Logic-RL evaluates.
    "reinforce_pp_knights_knaves": ",".join(
        f"kk{n}=gym:knights_knaves?n_people={n}&n=100;pass@1;t=1.0" for n in range(2, 9)
    ),
}


@pytest.mark.parametrize("name", PAPER_FLAGFILES)
def test_paper_flagfile_names_its_data_and_evaluates_the_papers_sets(name, parsed):
    """Data by registry name or gym task (no /data/... paths to fill in), and the paper's table
    as --eval_sets, each item parsed into its protocol."""
    config = parsed(f"--flagfile={REPO}/experiments/configs/{name}")
    assert not config.data.source.startswith(("parquet:", "jsonl:", "/")), config.data.source
    family = [k for k in PAPER_EVAL_SETS if name.startswith(k)]
    assert len(family) == 1, name
    assert config.evaluation.eval_sets == PAPER_EVAL_SETS[family[0]]
    sets = config.evaluation.sets
    assert [s.name for s in sets] == [
        item.split(";")[0].split("=")[0] for item in PAPER_EVAL_SETS[family[0]].split(",")
    ]
    if family[0].startswith("minimalist_"):
        assert all((s.temperature, s.samples) == (1.0, 16) for s in sets)
    if family[0] == "reinforce_pp_knights_knaves":
        assert all((s.temperature, s.samples, s.greedy) == (1.0, 1, False) for s in sets)


# The REINFORCE++ math runs start from Qwen2.5-Math-7B, whose context is 4,096 positions.
@pytest.mark.parametrize("name", ["reinforce_pp_math", "reinforce_pp_aime24"])
def test_reinforce_pp_math_runs_fit_the_base_models_context(name, parsed):
    from jaxrl4llm.config.errors import FlagError
    from jaxrl4llm.models.config import ARCHITECTURES

    config = parsed(f"--flagfile={REPO}/experiments/configs/{name}.flags")
    context = ARCHITECTURES["qwen2.5-math-7b"].max_position_embeddings
    assert context == 4096 and config.model.name.lower().endswith("qwen2.5-math-7b")
    config.validate_context(context)  # 1024 + 3072 = 4096
    # The lengths these files had (1024 + 4096) are refused, naming both flags.
    with pytest.raises(
        FlagError,
        match=r"--max_prompt_tokens=1024 \+ --max_new_tokens=4096 "
        r"= 5120 tokens exceed the context",
    ):
        config.replace(max_new_tokens=4096).validate_context(context)
    with pytest.raises(FlagError, match="item aime25's max_new_tokens=3500"):
        config.replace(eval_sets="aime25;max_new_tokens=3500").validate_context(context)


@pytest.mark.parametrize(
    "reinforce_pp", ["reinforce_pp_knights_knaves", "reinforce_pp_math", "reinforce_pp_aime24"]
)
def test_grpo_counterparts_differ_only_in_the_advantage_estimator(reinforce_pp, parsed):
    """The REINFORCE++ paper's comparisons change the estimator and nothing else."""
    a = options.flatten(parsed(f"--flagfile={REPO}/experiments/configs/{reinforce_pp}.flags"))
    b = options.flatten(parsed(f"--flagfile={REPO}/experiments/configs/{reinforce_pp}_grpo.flags"))
    assert {k for k in a if a[k] != b[k]} == {"algorithm", "advantage", "workdir"}
    assert b["advantage"] == "normalized" and (b["mean"], b["std"]) == ("group", "group")


def test_grpo_comparator_differs_from_lite_ppo_only_in_normalisation_and_aggregation(parsed):
    """Tricks-or-Traps' GRPO run: the Lite PPO flagfile with GRPO's group std and per-output
    token mean (the two techniques Lite PPO changes), nothing else."""
    a = options.flatten(
        parsed(f"--flagfile={REPO}/experiments/configs/tricks_or_traps_qwen3_8b_lite_ppo.flags")
    )
    b = options.flatten(
        parsed(f"--flagfile={REPO}/experiments/configs/tricks_or_traps_qwen3_8b_grpo.flags")
    )
    assert {k for k in a if a[k] != b[k]} == {"algorithm", "std", "agg", "workdir"}
    assert (b["mean"], b["std"], b["agg"], b["kl_in"], b["kl_coef"]) == (
        "group",
        "group",
        "seq-mean-token-mean",
        None,
        0.0,
    )


def test_dapo_comparator_differs_from_lite_ppo_only_in_the_algorithm(parsed):
    """Tricks-or-Traps' DAPO run: the Lite PPO flagfile with DAPO's algorithm knobs and its soft
    overlong punishment, and the row chunks of the one node it runs on; nothing else."""
    a = options.flatten(
        parsed(f"--flagfile={REPO}/experiments/configs/tricks_or_traps_qwen3_8b_lite_ppo.flags")
    )
    b = options.flatten(
        parsed(f"--flagfile={REPO}/experiments/configs/tricks_or_traps_qwen3_8b_dapo.flags")
    )
    assert {k for k in a if a[k] != b[k]} == {
        "algorithm",
        "std",
        "clip_high",
        "reject_all_correct",
        "reject_all_wrong",
        "dynamic_sampling",
        "overlong_buffer",
        "workdir",
        # The DAPO run is planned for one 8xh200 node, not the v5p-64 slice, with the row
        # chunks that fit it.
        "rollout_micro_batch",
        "micro_batch_size",
    }
    assert (b["std"], b["clip_high"], b["overlong_buffer"], b["max_new_tokens"]) == (
        "group",
        0.28,
        4096,
        8192,
    )


@pytest.mark.parametrize("name", PAPER_FLAGFILES)
def test_paper_flagfile_keeps_float32_master_weights(name, parsed):
    """At the papers' learning rates (5e-7 to 1e-6) bfloat16 weights lose most updates
    (tests/train/test_mixed_precision.py): every paper run keeps float32 weights and bfloat16
    matmuls, and starts without the precision warning."""
    config = parsed(f"--flagfile={REPO}/experiments/configs/{name}")
    assert (config.model.param_dtype, config.model.compute_dtype) == ("float32", "bfloat16")
    assert config.optimizer.learning_rate < 1e-5 and not config.precision_warnings()
