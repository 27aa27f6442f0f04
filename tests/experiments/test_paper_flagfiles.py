"""The paper flagfiles and presets against docs/algorithms.md ("Paper settings"), the papers'
hyperparameters, data and evaluation sets, context lengths and precision, and each comparator
run against the run it is compared with."""

import os
import re

import pytest

from jaxrl4llm import rl
from jaxrl4llm.config import options
from jaxrl4llm.train.config import TrainConfig

from tests.experiments.flagfile_paths import FLAGFILES, REPO

# ---- docs/algorithms.md "Paper settings": one source of truth for presets and flagfiles ----

DOCS = os.path.join(REPO, "docs", "algorithms.md")
PAPER_FLAGFILES = sorted(
    os.path.basename(f)
    for f in FLAGFILES
    if not f.endswith("quickstart.flags") and not os.path.basename(f).startswith("quickstart")
)


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
    # GSPO's Figure 1: AIME'24 (LiveCodeBench and CodeForces are not in the registry).
    "gspo": "aime24;avg@32;t=1.0",
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
    from jaxrl4llm.models.architectures import ARCHITECTURES

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
