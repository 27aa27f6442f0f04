"""Command-line entry points: absl flags generated from a config tree, one error contract,
and a quiet console.

    define_flags(TrainConfig)            # one flag per option (jaxrl4llm.config.options)
    config = config_from_flags(TrainConfig)
    if __name__ == "__main__":
        cli.run(main)                    # absl flags; cli.run(main, absl_flags=False) for a
                                         # script whose main parses cli.ArgumentParser

`run` is every entry point's contract (docs/reliability.md, "Exit codes"): a
`jaxrl4llm.config.errors.UserError`, a usage error or a malformed command line (an unknown flag, a
bad value, a missing --flagfile, a stray argument) prints one line, `Error: ...`, and exits 2
with no traceback; `--debug` or JAXRL4LLM_DEBUG=1 prints the traceback above that line.

Each flag has its option's flat name, type, default and help; options with choices are enums.
`--helpfull` lists the flags by sub-config ("rollout.sampling (SamplingConfig)"). A preset
option (`--algorithm`) picks its sub-config, and the other flags of that sub-config override
the preset only when they are given (their default is the preset's value).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from typing import Any, Callable, NoReturn, Sequence

from absl import app, flags, logging

from jaxrl4llm.config import options
from jaxrl4llm.config.errors import EXIT_USER_ERROR, FlagError, UserError, flag_errors, one_line

DEBUG_ENV = "JAXRL4LLM_DEBUG"
if "debug" not in flags.FLAGS:
    flags.DEFINE_boolean(
        "debug",
        False,
        "Print the traceback of a user error (a bad flag, "
        f"data source, model, ...) above its one-line message; or {DEBUG_ENV}=1.",
    )


class _OptionParser(flags.ArgumentParser):
    """Parses one option's command-line text (see options.parse_text)."""

    def __init__(self, option: options.Option):
        self.option = option
        if option.choices:
            self.syntactic_help = "one of " + "|".join(
                options.format_value(c) for c in option.choices
            )
        else:
            self.syntactic_help = "a " + options.type_name(option.type)

    def parse(self, argument: Any) -> Any:
        if not isinstance(argument, str):  # a typed default
            return argument
        return options.parse_text(self.option, argument)

    def flag_type(self) -> str:
        return options.type_name(self.option.type)


class _OptionSerializer(flags.ArgumentSerializer):
    def serialize(self, value: Any) -> str:
        return options.format_value(value)


def _module_name(option: options.Option) -> str:
    """The --helpfull section of an option: its sub-config."""
    return f"{option.group} ({option.group_class})" if option.group else option.group_class


def define_flags(root: type, flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
    """Defines one absl flag per option of the config tree class `root`; returns their names
    (an entry point declares them its key flags, so that --help lists them)."""
    for o in options.options(root):
        help_text = o.help
        default = o.default
        if o.role == "override":
            help_text += " (Default: the preset's value.)"
            default = None
        base, _ = options.base_type(o.type)
        module = _module_name(o)
        if base is bool and not o.choices:
            flags.DEFINE_boolean(
                o.name, default, help_text, flag_values=flag_values, module_name=module
            )
        else:
            flags.DEFINE(
                _OptionParser(o),
                o.name,
                default,
                help_text,
                flag_values=flag_values,
                serializer=_OptionSerializer(),
                module_name=module,
            )
    return [o.name for o in options.options(root)]


def _given(flag: Any) -> bool:
    return bool(flag.present) or flag.value != flag.default


def given_values(root: type, flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, Any]:
    """{flag name: value} of the options of `root` the user gave (on the command line or in a
    --flagfile); the others are at their defaults."""
    return {
        o.name: flag_values[o.name].value
        for o in options.options(root)
        if _given(flag_values[o.name])
    }


def config_from_flags(root: type, flag_values: flags.FlagValues = flags.FLAGS) -> Any:
    """The config tree the parsed flags describe (a preset's overrides only where given);
    a value a sub-config refuses raises FlagError."""
    values = {
        o.name: flag_values[o.name].value
        for o in options.options(root)
        if o.role != "override" or _given(flag_values[o.name])
    }
    with flag_errors():
        return options.replace(root(), **values)


# ---- the error contract -------------------------------------------------------------------


def debug_requested() -> bool:
    """--debug (on the command line or in a flagfile) or JAXRL4LLM_DEBUG=1."""
    if os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    if flags.FLAGS.is_parsed() and flags.FLAGS["debug"].value:
        return True
    return any(arg in ("--debug", "--debug=true", "--debug=1") for arg in sys.argv[1:])


def report(exc: BaseException) -> int:
    """Prints a user error as one line on stderr (its traceback first under --debug);
    returns the exit code, 2."""
    if debug_requested():
        traceback.print_exception(exc)
    print(one_line(exc), file=sys.stderr)
    return EXIT_USER_ERROR


def exit_code(main: Callable[..., int | None], *args: Any) -> int:
    """main(*args)'s exit code, a user error reported (see `report`); a bug propagates with
    its traceback (exit 1)."""
    try:
        code = main(*args)
    except (UserError, app.UsageError) as exc:
        return report(exc)
    return 0 if code is None else int(code)


def parse_flags(argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
    """Parses an absl command line; a malformed one (unknown flag, bad value, missing
    --flagfile, a stray positional argument) raises FlagError naming it."""
    try:
        args = flag_values(list(argv))
    except flags.Error as exc:
        raise FlagError(_flag_error_text(exc, flag_values)) from exc
    if len(args) > 1:
        raise FlagError(
            f"Unexpected argument(s) {' '.join(args[1:])!r}: every option is a "
            "--flag=VALUE (--helpfull lists them)."
        )
    return args


def _flag_error_text(exc: flags.Error, flag_values: flags.FlagValues) -> str:
    """absl's message, naming the flag and the fix."""
    text = str(exc)
    if isinstance(exc, flags.CantOpenFlagFileError):
        return (
            f"--flagfile: {text.removeprefix('ERROR:: ').strip()}; check the path (relative "
            "paths are from the current folder)."
        )
    match = re.match(r"flag --(\w+)=(.*?): (.*)$", text, re.S)
    if match:
        name, value, why = match.groups()
        if why.startswith("--"):
            text = why  # our parser's message already names the flag and value
        elif name in flag_values and flag_values[name].boolean:
            text = f"--{name}={value} is not a boolean: use --{name}=true or --{name}=false"
    return f"{text.rstrip('. ')}; --helpfull lists the flags."


def _parse_or_exit(argv: Sequence[str]) -> list[str]:
    try:
        return parse_flags(argv)
    except FlagError as exc:
        sys.exit(report(exc))


def run(
    main: Callable[..., int | None], *, absl_flags: bool = True, argv: Sequence[str] | None = None
) -> NoReturn:
    """Runs an entry point under the error contract and exits with its code.

    absl_flags: main(argv) of an absl program (flags parsed first, by `parse_flags`); else
    main(argv[1:]) of a script that parses its own arguments (with `ArgumentParser`).
    """
    argv = list(sys.argv if argv is None else argv)
    if absl_flags:
        app.run(lambda args: exit_code(main, args), argv=argv, flags_parser=_parse_or_exit)
    sys.exit(exit_code(main, argv[1:]))


class ArgumentParser(argparse.ArgumentParser):
    """argparse under the error contract: a bad command line raises FlagError (one line,
    exit 2 through `run`) instead of printing the usage; adds --debug."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--debug",
            action="store_true",
            help=f"print the traceback of a user error (or {DEBUG_ENV}=1)",
        )

    def error(self, message: str) -> NoReturn:
        raise FlagError(f"{self.prog}: {message.rstrip('. ')} (--help lists the arguments).")


def quiet_logs(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Library INFO logs (orbax, jax, ...) off unless --verbosity was given: the console then
    shows the progress bar, one line per step, warnings and errors."""
    if not flag_values["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
