"""Config trees: frozen dataclasses whose leaf fields are the command-line options.

A config tree is a frozen dataclass whose fields are leaves (str, int, float, bool, an
Optional of one, a tuple of numbers) or sub-configs mounted with `group(...)`. Every leaf is
an *option* with
  - a flat name: the field name, unless the mount renames it (`flags={"b1": "adam_b1"}`);
  - a type: the field's annotation;
  - a default: the field's value in the root's default tree;
  - help: the line "name: text" of its class docstring (continued on indented lines);
  - choices, where the mount declares them (`choices={"mean": MEANS}`).
So a new field is a new option with no other edit. `options(TrainConfig)` lists them;
`jaxrl4llm.config.cli` turns them into absl flags; `replace(tree, **flat)` sets them by flat name;
`to_dict` / `from_dict` round-trip a tree through JSON. This module is pure Python.

A mount may also derive a field from another option (`derived={"max_new_tokens":
"max_new_tokens"}`: the reward's copy of the rollout length, not an option of its own), and
give the group presets (`preset=rl.get_preset` with the preset name as the option renamed
from `name`): the preset option picks a whole sub-config, and the group's other options
override it only where they are set. A group of another layer's knobs that a preset also sets
follows that preset option (`preset_from="algorithm"`, with `preset` mapping the preset's name
to this group's values): DAPO's dynamic sampling is the trainer's, not the loss library's, yet
`--algorithm=dapo` turns it on.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import types
import typing
from typing import Any, Callable, Mapping

from jaxrl4llm.config.errors import FlagError

_MOUNT = "jaxrl4llm.config.options.mount"


def require(cond: Any, message: str) -> None:
    """Raises FlagError(message) (a ValueError) unless `cond`: every user-facing check in one
    form; the message names the flag and the fix."""
    if not cond:
        raise FlagError(message)


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity
class Mount:
    """How a sub-config class sits in its tree (see the module docstring)."""

    flags: Mapping[str, str] = dataclasses.field(default_factory=dict)
    choices: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    derived: Mapping[str, str] = dataclasses.field(default_factory=dict)
    preset: Callable[[str], Any] | None = None  # name -> sub-config (e.g. rl.get_preset)
    preset_field: str = "name"
    preset_from: str | None = None  # another group's preset option that picks this group too


def group(default: Callable[[], Any], **mount: Any) -> Any:
    """A sub-config field of a config tree; `default()` is its value in the default tree."""
    return dataclasses.field(default_factory=default, metadata={_MOUNT: Mount(**mount)})


@dataclasses.dataclass(frozen=True)
class Option:
    """One leaf of a config tree, as the command line sees it."""

    name: str  # the flat name (the flag)
    path: tuple[str, ...]  # field names from the root
    type: Any  # the resolved annotation
    default: Any  # its value in the root's default tree
    help: str
    choices: tuple | None
    group: str  # dotted path of its sub-config ("" at the root)
    group_class: str  # the sub-config's class name
    role: str  # "value"; "preset" (picks its group); "override" (of a preset)


def _mount(f: dataclasses.Field) -> Mount | None:
    return f.metadata.get(_MOUNT)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: help} from the class docstring's "name: text" / "a, b: text" lines."""
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    docs: dict[str, str] = {}
    current: list[str] = []
    for line in doc.splitlines():
        m = re.match(r"^([a-z_][a-z0-9_]*(?:\s*,\s*[a-z_][a-z0-9_]*)*):\s+(\S.*)$", line)
        if m:
            current = [n.strip() for n in m.group(1).split(",")]
            for n in current:
                docs[n] = m.group(2).strip()
        elif current and line.startswith((" ", "\t")) and line.strip():
            for n in current:
                docs[n] += " " + line.strip()
        else:
            current = []
    return docs


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _walk(cls: type, path: tuple[str, ...], mount: Mount, out: list[Option]) -> None:
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        sub = _mount(f)
        if sub is not None:
            _walk(_hints(cls)[f.name], path + (f.name,), sub, out)
            continue
        if f.name in mount.derived:
            continue
        role = "value"
        if mount.preset_from is not None:
            role = "override"
        elif mount.preset is not None:
            role = "preset" if f.name == mount.preset_field else "override"
        out.append(
            Option(
                name=mount.flags.get(f.name, f.name),
                path=path + (f.name,),
                type=_hints(cls)[f.name],
                default=None,
                help=docs.get(f.name) or f"{cls.__name__}.{f.name}",
                choices=mount.choices.get(f.name),
                group=".".join(path),
                group_class=cls.__name__,
                role=role,
            )
        )


@functools.cache
def _option_specs(root: type) -> tuple[Option, ...]:
    """The options of `root` without their defaults (needs no instance of `root`)."""
    out: list[Option] = []
    _walk(root, (), Mount(), out)
    seen: dict[str, Option] = {}
    for o in out:
        if o.name in seen:
            raise TypeError(
                f"Option name {o.name!r} is used by both {'.'.join(seen[o.name].path)} "
                f"and {'.'.join(o.path)}; rename one at its mount (flags={{...}})."
            )
        seen[o.name] = o
    return tuple(out)


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        tree = getattr(tree, name)
    return tree


@functools.cache
def options(root: type) -> tuple[Option, ...]:
    """Every option of the config tree class `root`, in field order; flat names are unique."""
    default = root()
    return tuple(dataclasses.replace(o, default=_get(default, o.path)) for o in _option_specs(root))


def option_map(root: type) -> dict[str, Option]:
    return {o.name: o for o in options(root)}


# ---- values -------------------------------------------------------------------------------


def base_type(tp: Any) -> tuple[Any, bool]:
    """(the type without Optional, whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def type_name(tp: Any) -> str:
    base, optional = base_type(tp)
    origin = typing.get_origin(base)
    name = (
        f"comma-separated {typing.get_args(base)[0].__name__}s"
        if origin is tuple
        else getattr(base, "__name__", str(base))
    )
    return f"{name} or none" if optional and base is not str else name


def parse_text(option: Option, text: str) -> Any:
    """A command-line string -> the option's value; ValueError names the option and the type."""
    base, optional = base_type(option.type)
    low = text.strip().lower()

    def bad() -> FlagError:
        allowed = f"; choose one of {_choices_text(option.choices)}" if option.choices else ""
        return FlagError(
            f"--{option.name}={text!r} is not a valid {type_name(option.type)}{allowed}."
        )

    is_free_text = base is str and not option.choices
    value: Any
    if optional and not is_free_text and low in ("none", "null", ""):
        value = None
    elif base is bool:
        if low not in ("true", "false", "1", "0", "yes", "no"):
            raise bad()
        value = low in ("true", "1", "yes")
    elif typing.get_origin(base) is tuple:
        element = typing.get_args(base)[0]
        try:
            value = tuple(element(x) for x in text.split(","))
        except ValueError:
            raise bad() from None
    elif base is str:
        value = text
    else:
        try:
            value = base(text)
        except ValueError:
            raise bad() from None
    if option.choices is not None and value not in option.choices:
        raise bad()
    return value


def _choices_text(choices: tuple) -> str:
    return "|".join("none" if c is None else str(c) for c in choices)


def format_value(value: Any) -> str:
    """The command-line spelling of a value (inverse of parse_text)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


# ---- trees --------------------------------------------------------------------------------


def flatten(tree: Any) -> dict[str, Any]:
    """{flat name: value} of every option of a tree."""
    root: type = type(tree)  # not type[Any], which mypy finds not Hashable (functools.cache)
    return {o.name: _get(tree, o.path) for o in _option_specs(root)}


def _build(
    cls: type,
    values: Mapping[str, Any],
    path: tuple[str, ...],
    mount: Mount,
    names: Mapping[tuple[str, ...], str],
) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = _mount(f)
        if sub is not None:
            kwargs[f.name] = _build(_hints(cls)[f.name], values, path + (f.name,), sub, names)
        elif f.name in mount.derived:
            kwargs[f.name] = values[mount.derived[f.name]]
        else:
            kwargs[f.name] = values[names[path + (f.name,)]]
    return cls(**kwargs)


def _groups(root: type) -> dict[str, tuple[tuple[str, ...], type, Mount]]:
    """{field name: (path, class, mount)} of every sub-config in the tree."""
    out = {}

    def walk(cls: type, path: tuple[str, ...]) -> None:
        for f in dataclasses.fields(cls):
            sub = _mount(f)
            if sub is not None:
                out[f.name] = (path + (f.name,), _hints(cls)[f.name], sub)
                walk(_hints(cls)[f.name], path + (f.name,))

    walk(root, ())
    return out


def _rebuild(root: type, flat: Mapping[str, Any], field: str) -> Any:
    """The top-level sub-config `field` of `root` built from flat option values."""
    path, cls, mount = _groups(root)[field]
    names = {o.path: o.name for o in _option_specs(root)}
    return _build(cls, flat, path, mount, names)


def fill_derived(tree: Any) -> None:
    """Recomputes the derived fields of a tree under construction (call it from the root's
    __post_init__): each top-level sub-config holding one is rebuilt from the options."""
    root: type = type(tree)
    flat = None
    for f in dataclasses.fields(root):
        if _mount(f) is None or not _has_derived(_hints(root)[f.name], _mount(f)):
            continue
        flat = flatten(tree) if flat is None else flat
        object.__setattr__(tree, f.name, _rebuild(root, flat, f.name))


@functools.cache
def _has_derived(cls: type, mount: Mount) -> bool:
    return bool(mount.derived) or any(
        _has_derived(_hints(cls)[f.name], _mount(f))
        for f in dataclasses.fields(cls)
        if _mount(f) is not None
    )


def _follow_preset(
    flat: dict[str, Any], specs: tuple[Option, ...], groups: dict, option: str, value: Any
) -> None:
    """Sets in `flat` the options of every group mounted with `preset_from=option` to their
    values for the preset `value`."""
    for path, _, mount in groups.values():
        if mount.preset_from == option:
            preset = mount.preset(value)
            flat.update(
                {o.name: _get(preset, o.path[len(path) :]) for o in specs if o.path[:-1] == path}
            )


def replace(tree: Any, **values: Any) -> Any:
    """`tree` with options set by flat name.

    A sub-config's field name takes a whole sub-config (`optimizer=OptimizerConfig(...)`), and
    a preset option a preset by name (`algorithm="lite_ppo"`); both apply before the plain
    options given beside them, so `algorithm="grpo", kl_coef=0` is GRPO without KL.
    """
    root: type = type(tree)
    specs = _option_specs(root)
    by_name = {o.name: o for o in specs}
    groups = _groups(root)
    flat = flatten(tree)
    plain = {}
    for name, value in values.items():
        if name in groups and dataclasses.is_dataclass(value) and not isinstance(value, type):
            path, _, mount = groups[name]
            flat.update(
                {
                    o.name: _get(value, o.path[len(path) :])
                    for o in specs
                    if o.path[: len(path)] == path
                }
            )
            if mount.preset is not None:  # the groups that follow its preset follow its name
                preset_option = next(
                    o.name for o in specs if o.path == path + (mount.preset_field,)
                )
                _follow_preset(
                    flat, specs, groups, preset_option, getattr(value, mount.preset_field)
                )
        elif name in by_name and by_name[name].role == "preset":
            path = by_name[name].path[:-1]
            mount = next(m for p, _, m in groups.values() if p == path)
            assert mount.preset is not None  # a "preset" option's mount has one
            preset = mount.preset(value)
            flat.update(
                {o.name: _get(preset, o.path[len(path) :]) for o in specs if o.path[:-1] == path}
            )
            _follow_preset(flat, specs, groups, name, value)
        elif name in by_name:
            plain[name] = value
        else:
            raise FlagError(
                f"Unknown option {name!r}; valid options: {', '.join(sorted(by_name))}."
            )
    flat.update(plain)
    return root(
        **{
            f.name: (_rebuild(root, flat, f.name) if _mount(f) is not None else flat[f.name])
            for f in dataclasses.fields(root)
        }
    )


def to_dict(tree: Any) -> dict[str, Any]:
    """The tree as nested plain dicts (JSON-able: tuples become lists in json.dumps)."""
    return dataclasses.asdict(tree)


def from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    """Inverse of to_dict. Missing fields take their defaults; unknown keys are ignored (a
    config written by an older or newer version still loads)."""
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if _mount(f) is not None:
            value = from_dict(hints[f.name], value)
        elif isinstance(value, list) and typing.get_origin(base_type(hints[f.name])[0]) is tuple:
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)
