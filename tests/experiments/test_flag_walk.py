"""Every flag of `experiments.train`, one bad value each, in-process: exit 2, one line on
stderr naming it, and the model never starts loading (a bad value found after the model
load would cost a user minutes, or a cluster job's queue time)."""

from __future__ import annotations

import typing

import pytest
from absl import flags

from experiments import train
from jaxrl4llm.config import cli, options
from jaxrl4llm.config.errors import EXIT_USER_ERROR
from jaxrl4llm.models import registry
from jaxrl4llm.train.config import TrainConfig

# Any finite value is meaningful: a seed, a negative entropy bonus, a Clip-Cov covariance
# band's lower end (a token's covariance may be negative; only lb < ub is checked).
SIGNED = {"seed", "entropy_coef", "clip_cov_lb"}


class ModelLoadStarted(Exception):
    """Raised by the patched loader: a bad value got past every check."""


def bad_values(o: options.Option, tmp_path) -> list[str]:
    """Bad command-line values of an option, from its type and choices."""
    base, _ = options.base_type(o.type)
    if o.choices:
        return ["no_such_choice"]
    if base is bool:
        return ["maybe"]
    if typing.get_origin(base) is tuple:
        return ["1,two"]
    if base is int:
        return ["1.5x"] + ([] if o.name in SIGNED else ["-7"])
    if base is float:
        return ["fast", "nan", "inf"] + ([] if o.name in SIGNED else ["-7.0"])
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    return FREE_TEXT[o.name](a_file)


# Free-text options: a value each that is wrong (None: every text is a valid value).
FREE_TEXT = {
    "model": lambda f: [str(f.parent / "no_such_model"), "no-such-model"],
    "data": lambda f: ["no_such_scheme:x", f"jsonl:{f.parent / 'missing.jsonl'}"],
    "data_revision": lambda f: ["v1"],  # only an hf: source has revisions
    "prompt_field": lambda f: ["no_such_column"],
    "answer_field": lambda f: ["no_such_column"],
    "instruction": lambda f: ["@no_such_prompt"],
    "system_prompt": lambda f: ["@no_such_prompt"],
    "example": lambda f: ["@no_such_example", str(f)],  # a_file is not JSON
    "critic_model": lambda f: [str(f.parent / "no_such_model")],
    "eval_data": lambda f: ["no_such_scheme:x"],
    "eval_sets": lambda f: ["math500;bogus@3"],
    "mesh": lambda f: ["data:x"],
    "rollout_engine": lambda f: ["compacted", "vllm"],  # compacted: no longer a trainer engine
    "workdir": lambda f: [str(f)],
    "trackers": lambda f: ["comet", "tensorboard,no_such_tracker"],
    "env": lambda f: ["no_such_env", "calculator?no_such_option=1"],
    "init_adapter": lambda f: [str(f), str(f.parent / "no_such_adapter")],
}


def _cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("walk")
    return [(o.name, v) for o in options.options(TrainConfig) for v in bad_values(o, tmp)]


@pytest.fixture
def run_train(tmp_path, monkeypatch, capsys):
    """train.main under the error contract, in-process: (exit code, stderr lines)."""

    def boom(*args, **kwargs):
        raise ModelLoadStarted()

    monkeypatch.setattr(registry, "load_model", boom)
    model = tmp_path / "model"  # a model folder the flag check accepts (never loaded)
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")

    def run(*argv: str) -> tuple[int, list[str]]:
        flags.FLAGS.unparse_flags()
        args = ["train", f"--model={model}", f"--workdir={tmp_path / 'run'}", *argv]
        try:
            code = cli.exit_code(lambda: train.main(cli.parse_flags(args)))
        finally:
            flags.FLAGS.unparse_flags()
        return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]

    return run


def test_every_option_has_a_bad_value():
    names = {
        o.name
        for o in options.options(TrainConfig)
        if options.base_type(o.type)[0] is str and not o.choices
    }
    assert names == set(FREE_TEXT)


def test_the_good_flags_reach_the_model_load(run_train):
    """The harness can fail: valid flags get past every check to the (patched) loader."""
    with pytest.raises(ModelLoadStarted):
        run_train("--num_steps=1")


def test_every_flag_with_a_bad_value_fails_in_one_line_before_the_model_loads(
    run_train, tmp_path_factory
):
    failures = []
    for name, value in _cases(tmp_path_factory):
        try:
            code, lines = run_train(f"--{name}={value}")
        except ModelLoadStarted:
            failures.append(f"--{name}={value}: accepted, the model load started")
            continue
        if code != EXIT_USER_ERROR or len(lines) != 1 or not lines[0].startswith("Error: "):
            failures.append(f"--{name}={value}: exit {code}, stderr {lines}")
        elif name not in lines[0] and value.split(":", 1)[-1] not in lines[0]:
            failures.append(f"--{name}={value}: the message names neither: {lines[0]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--no_such_flag=1"], "Unknown command line flag 'no_such_flag'"),
        (["--flagfile=/no/such.flags"], "--flagfile: "),
        (["stray"], "Unexpected argument(s) 'stray'"),
        (["--algorithm=nope"], "--algorithm='nope' is not a valid"),
        (["--format_penalty=-1"], "--format_penalty=-1.0 must be >= 0"),
        (["--overlong_buffer=-5"], "--overlong_buffer=-5 must be in [0, --max_new_tokens=128]"),
        (["--reward_scale=logic_rl", "--format_penalty=0.5"], "does not apply to --reward_scale"),
        (["--overlong_buffer=200"], "--overlong_buffer=200 must be in [0"),
    ],
)
def test_command_line_errors_name_the_input(run_train, argv, expected):
    code, lines = run_train(*argv)
    assert code == EXIT_USER_ERROR and len(lines) == 1, lines
    assert expected in lines[0]
