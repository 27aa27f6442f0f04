"""Command-line entry points: absl flags generated from a config tree, and a quiet console.

    define_flags(TrainConfig)            # one flag per option (jaxrl4llm.options)
    config = config_from_flags(TrainConfig)

Each flag has its option's flat name, type, default and help; options with choices are enums.
`--helpfull` lists the flags by sub-config ("rollout.sampling (SamplingConfig)"). A preset
option (`--algorithm`) picks its sub-config, and the other flags of that sub-config override
the preset only when they are given (their default is the preset's value).
"""
from __future__ import annotations

from typing import Any

from absl import flags, logging

from jaxrl4llm import options


class _OptionParser(flags.ArgumentParser):
    """Parses one option's command-line text (see options.parse_text)."""

    def __init__(self, option: options.Option):
        self.option = option
        if option.choices:
            self.syntactic_help = "one of " + "|".join(
                options.format_value(c) for c in option.choices)
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
            flags.DEFINE_boolean(o.name, default, help_text, flag_values=flag_values,
                                 module_name=module)
        else:
            flags.DEFINE(_OptionParser(o), o.name, default, help_text, flag_values=flag_values,
                         serializer=_OptionSerializer(), module_name=module)
    return [o.name for o in options.options(root)]


def _given(flag: Any) -> bool:
    return bool(flag.present) or flag.value != flag.default


def given_values(root: type, flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, Any]:
    """{flag name: value} of the options of `root` the user gave (on the command line or in a
    --flagfile); the others are at their defaults."""
    return {o.name: flag_values[o.name].value for o in options.options(root)
            if _given(flag_values[o.name])}


def config_from_flags(root: type, flag_values: flags.FlagValues = flags.FLAGS) -> Any:
    """The config tree the parsed flags describe (a preset's overrides only where given)."""
    values = {o.name: flag_values[o.name].value for o in options.options(root)
              if o.role != "override" or _given(flag_values[o.name])}
    return options.replace(root(), **values)


def quiet_logs(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Library INFO logs (orbax, jax, ...) off unless --verbosity was given: the console then
    shows the progress bar, one line per step, warnings and errors."""
    if not flag_values["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
