"""Study specs: a base flagfile per scale plus named arms (flag overrides) x seeds, in TOML.

    name = "minimalist_fig4"
    description = "..."
    primary_metric = "eval/mean/avg@16"  # the eval score of AUC, threshold and claims
    threshold = 0.3                      # "steps to reach": first eval step with score >= it

    [scales.cpu]                         # one table per scale; `--scale=cpu` picks it
    flags = ["--flagfile=experiments/studies/cpu_arithmetic.flags", "--log_kl_ref"]
    seeds = [0, 1, 2]
    primary_metric = "eval/accuracy"     # a scale may override primary_metric / threshold
    threshold = 0.5
    note = "base pass rate 31% (measured with ...)"

    [[arms]]
    name = "reinforce"
    source = "Minimalist (arXiv 2504.11343) §4.1, Figure 4's variant 1"  # paper, arXiv id, place
    flags = ["--algorithm=reinforce"]    # every scale
    paper = ["--flagfile=experiments/configs/minimalist_llama32_3b_instruct_reinforce.flags"]

    [[claims]]                           # fixed before the runs; judged from the report
    text = "Removing all-wrong groups helps more than removing all-correct ones."
    source = "Minimalist (arXiv 2504.11343) §4.1, on Figure 4"  # where the paper says it
    a = "rm_all_wrong"
    b = "rm_all_correct"
    quantity = "final"                   # final | best | auc | steps | any report quantity
    expect = ">"                         # a > b (or "<"; or "~": |a - b| < margin)
    margin = 0.05                        # "~" only: the difference that counts as a match

A run's command line is the scale's flags, then the arm's `flags`, then the arm's flags for
the scale (a key named after it), then --seed and --workdir: later flags win (absl reads a
--flagfile's lines where it stands). Relative paths in flags are relative to the repository
root, where every run starts.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
import tomllib
from typing import TYPE_CHECKING, Any, Sequence

from jaxrl4llm.config import paths
from jaxrl4llm.config.options import require

if TYPE_CHECKING:
    from jaxrl4llm.train.config import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDIES_DIR = os.path.join(REPO, "experiments", "studies")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-+]+$")
SHORT_QUANTITIES = ("final", "best", "auc", "steps")
EXPECTS = (">", "<", "~")


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    flags: tuple[str, ...]
    scale_flags: dict[str, tuple[str, ...]]  # extra flags for one scale, by scale name
    source: str = ""  # where the paper defines the arm: "Paper (arXiv ID) section, equation..."

    def command_flags(self, scale: str) -> tuple[str, ...]:
        return self.flags + self.scale_flags.get(scale, ())


@dataclasses.dataclass(frozen=True)
class Scale:
    name: str
    flags: tuple[str, ...]
    seeds: tuple[int, ...]
    primary_metric: str
    threshold: float | None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Claim:
    text: str
    a: str
    b: str
    quantity: str  # a report quantity, or one of SHORT_QUANTITIES (of the primary metric)
    expect: str  # ">" or "<": a vs b; "~": |a - b| < margin
    source: str = ""  # where the paper says it: "Paper (arXiv ID) section, table or figure"
    margin: float | None = None  # "~" only


@dataclasses.dataclass(frozen=True)
class Study:
    name: str
    description: str
    arms: tuple[Arm, ...]
    scales: dict[str, Scale]
    claims: tuple[Claim, ...]
    path: str
    final_window: int = 5  # training metrics' "final": the mean of the last this many steps

    def scale(self, name: str) -> Scale:
        require(
            name in self.scales,
            f"--scale={name}: study {self.name} ({self.path}) has scales {', '.join(self.scales)}",
        )
        return self.scales[name]


@dataclasses.dataclass(frozen=True)
class Run:
    arm: str
    seed: int
    workdir: str
    argv: tuple[str, ...]  # the training command, run from the repository root
    num_steps: int  # its resolved --num_steps: the run is finished at this step
    arm_flags: tuple[str, ...] = ()  # the arm's own flags at this scale (in argv)

    @property
    def label(self) -> str:
        return f"{self.arm}/seed_{self.seed}"

    def shell(self) -> str:
        return " ".join(shlex.quote(a) for a in ("python",) + self.argv[1:])


def find_spec(name_or_path: str) -> str:
    """--study=NAME (experiments/studies/NAME.toml) or a path to a .toml file."""
    if os.path.exists(name_or_path):
        return name_or_path
    path = os.path.join(STUDIES_DIR, f"{name_or_path}.toml")
    if os.path.exists(path):
        return path
    known = sorted(f[:-5] for f in os.listdir(STUDIES_DIR) if f.endswith(".toml"))
    raise ValueError(
        f"--study={name_or_path}: no such file, and not a shipped study "
        f"(experiments/studies/: {', '.join(known)})"
    )


def _strings(value: Any, where: str) -> tuple[str, ...]:
    require(
        isinstance(value, list) and all(isinstance(v, str) for v in value),
        f'{where} must be a list of strings (flags such as "--num_steps=8")',
    )
    for v in value:
        require(v.startswith("--"), f"{where}: {v!r} is not a --flag")
        require(
            not v.startswith(("--seed=", "--workdir=")),
            f"{where}: {v!r}: the study sets --seed and --workdir of each run itself",
        )
    return tuple(value)


def _name(value: Any, where: str) -> str:
    require(
        isinstance(value, str) and _NAME_RE.match(value),
        f"{where}: {value!r} must be a name of letters, digits, '_', '-', '.', '+'",
    )
    return value


def load_study(name_or_path: str) -> Study:
    path = find_spec(name_or_path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    unknown = set(raw) - {
        "name",
        "description",
        "primary_metric",
        "threshold",
        "scales",
        "arms",
        "claims",
        "final_window",
    }
    require(not unknown, f"{path}: unknown keys {sorted(unknown)}")
    name = _name(raw.get("name", os.path.splitext(os.path.basename(path))[0]), f"{path}: name")
    require(raw.get("scales"), f"{path}: needs at least one [scales.NAME] table")
    scales = {}
    for s_name, s in raw["scales"].items():
        where = f"{path}: [scales.{s_name}]"
        seeds = s.get("seeds", [0, 1, 2])
        require(
            seeds and all(isinstance(x, int) for x in seeds) and len(set(seeds)) == len(seeds),
            f"{where}: seeds must be distinct integers",
        )
        primary = s.get("primary_metric", raw.get("primary_metric"))
        require(
            isinstance(primary, str) and primary.startswith("eval/"),
            f"{where}: primary_metric (here or at the top) must name an eval metric, "
            f'e.g. "eval/accuracy" or "eval/mean/avg@16"',
        )
        threshold = s.get("threshold", raw.get("threshold"))
        scales[s_name] = Scale(
            _name(s_name, where),
            _strings(s.get("flags", []), f"{where} flags"),
            tuple(seeds),
            primary,
            None if threshold is None else float(threshold),
            s.get("note", ""),
        )
    arms = []
    for i, a in enumerate(raw.get("arms", [])):
        where = f"{path}: arm {i + 1}"
        arm_name = _name(a.get("name"), f"{where} name")
        extra = set(a) - {"name", "flags", "source"} - set(scales)
        require(
            not extra,
            f"{where} ({arm_name}): unknown keys {sorted(extra)} (a scale's flags "
            f"go under its name: {', '.join(scales)})",
        )
        arms.append(
            Arm(
                arm_name,
                _strings(a.get("flags", []), f"{where} flags"),
                {s: _strings(a[s], f"{where} {s}") for s in scales if s in a},
                str(a.get("source", "")),
            )
        )
    names = [a.name for a in arms]
    require(
        len(arms) >= 1 and len(set(names)) == len(names),
        f"{path}: needs [[arms]] with distinct names (got {names})",
    )
    claims = []
    for i, c in enumerate(raw.get("claims", [])):
        where = f"{path}: claim {i + 1}"
        require(
            c.get("a") in names and c.get("b") in names,
            f"{where}: a and b must name arms ({', '.join(names)})",
        )
        require(c.get("expect") in EXPECTS, f'{where}: expect must be ">", "<" or "~"')
        margin = c.get("margin")
        require(
            (c["expect"] == "~") == (margin is not None)
            and (margin is None or (isinstance(margin, (int, float)) and margin > 0)),
            f'{where}: expect = "~" needs margin = D > 0 (|a - b| < D counts as a match), '
            "and only it has one",
        )
        claims.append(
            Claim(
                c.get("text", ""),
                c["a"],
                c["b"],
                c.get("quantity", "final"),
                c["expect"],
                str(c.get("source", "")),
                None if margin is None else float(margin),
            )
        )
    return Study(
        name,
        raw.get("description", "").strip(),
        tuple(arms),
        scales,
        tuple(claims),
        path,
        int(raw.get("final_window", 5)),
    )


def select(
    study: Study, arms: str = "", seeds: str = "", scale: str = "cpu"
) -> tuple[list[Arm], tuple[int, ...]]:
    """The arms (--arms=a,b; default all, in spec order) and seeds (--seeds=0,1) to run."""
    chosen = list(study.arms)
    if arms:
        wanted = [a.strip() for a in arms.split(",") if a.strip()]
        missing = [a for a in wanted if a not in {x.name for x in study.arms}]
        require(
            not missing,
            f"--arms: {missing} not in study {study.name} "
            f"({', '.join(a.name for a in study.arms)})",
        )
        chosen = [a for a in study.arms if a.name in wanted]
    seed_list = study.scale(scale).seeds
    if seeds:
        try:
            seed_list = tuple(int(s) for s in seeds.split(","))
        except ValueError:
            raise ValueError(f"--seeds={seeds!r}: give integers, e.g. --seeds=0,1,2") from None
    return chosen, seed_list


def resolve_num_steps(train_flags: Sequence[str], where: str) -> int:
    """A run's --num_steps (resolve_config), and a clear error for a bad flag before any run
    starts."""
    return resolve_config(train_flags, where).run.num_steps


def resolve_config(train_flags: Sequence[str], where: str) -> TrainConfig:
    """A run's TrainConfig from its flags, parsed with the trainer's own flag definitions
    (flagfiles read from the repository root)."""
    from absl import flags as absl_flags

    from jaxrl4llm.config import cli
    from jaxrl4llm.train.config import TrainConfig

    values = absl_flags.FlagValues()
    cli.define_flags(TrainConfig, values)
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        values(["train", *train_flags])
        config = cli.config_from_flags(TrainConfig, values)
    except (absl_flags.Error, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    finally:
        os.chdir(cwd)
    return config


def plan(
    study: Study,
    scale: str,
    root: str,
    arms: list[Arm] | None = None,
    seeds: tuple[int, ...] | None = None,
    python: str = sys.executable,
) -> list[Run]:
    """One Run per arm x seed, arm by arm (an arm's seeds finish together), in spec order."""
    s = study.scale(scale)
    arms = list(study.arms) if arms is None else arms
    seeds = s.seeds if seeds is None else seeds
    runs, num_steps = [], {}
    for arm in arms:
        for seed in seeds:
            workdir = paths.join(paths.absolute(root), arm.name, f"seed_{seed}")
            train_flags = (
                *s.flags,
                *arm.command_flags(scale),
                f"--seed={seed}",
                f"--workdir={workdir}",
            )
            if arm.name not in num_steps:
                num_steps[arm.name] = resolve_num_steps(
                    train_flags, f"{study.path}: arm {arm.name} at scale {scale}"
                )
            runs.append(
                Run(
                    arm.name,
                    seed,
                    workdir,
                    (python, "-m", "experiments.train", *train_flags),
                    num_steps[arm.name],
                    arm.command_flags(scale),
                )
            )
    return runs
