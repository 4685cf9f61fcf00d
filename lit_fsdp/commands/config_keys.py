"""Unknown keys in ``fit``/``validate`` config files and options, and values outside an option's choices, all found
before LightningCLI parses, each with the nearest valid key or choice: jsonargparse stops at the first, and one inside
a strategy's arguments reaches the user only as "Does not validate against any of the Union subtypes"."""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from jsonargparse import ArgumentParser

from lit_fsdp.errors import ErrorBlock, error_line

#: Keys every class-typed value takes besides its class's arguments.
CLASS_KEYS = ("class_path", "init_args", "dict_kwargs")
#: Where an option's mistake is, in the block.
COMMAND_LINE = "the command line"
#: Types whose values hold no keys to check.
_PLAIN_MODULES = ("builtins", "typing", "collections.abc", "pathlib", "datetime", "types")


class UnknownKeysError(ErrorBlock):
    """Config keys (or options) no parser takes, and values no choice matches: a short block, one line per mistake,
    shown whole."""


class Mistake(NamedTuple):
    """A key no parser takes (``is_value`` False) or a value outside its key's choices; ``of``: the class whose
    argument the key is, named after the line (the innermost, for a dataclass inside a strategy's arguments)."""

    line: str
    is_value: bool = False
    of: str | None = None

    def __str__(self) -> str:
        return self.line + (f" (of {self.of})" if self.of else "")


def check(parser: ArgumentParser, args: list[str], command: str) -> None:
    """Raise ``UnknownKeysError`` naming every key of every ``--config`` file in ``args`` (and every ``--a.b`` option)
    that ``parser`` (``command``'s) does not take, with the nearest one that it does, and every value outside its
    key's choices (a ``Literal``), with the nearest choice."""
    classes = _default_classes(parser)
    unknown: dict[str, list[Mistake]] = {}
    for index, arg in enumerate(args):
        if arg == "--config" or arg.startswith("--config="):
            name = arg.split("=", 1)[1] if "=" in arg else (args[index + 1] if index + 1 < len(args) else None)
            content = _read(name)
            if isinstance(content, dict):
                found = _unknown_in(parser, content, "", classes)
                if found:
                    unknown.setdefault(str(Path(name).resolve()), []).extend(found)
        elif arg.startswith("--") and not arg.startswith(("--print_config", "--help")):
            key = arg[2:].split("=", 1)[0]
            if not key.endswith(("+", ".help")):
                following = args[index + 1] if index + 1 < len(args) else None
                value = arg.split("=", 1)[1] if "=" in arg else (
                    following if following is not None and not following.startswith("--") else None)
                unknown.setdefault(COMMAND_LINE, []).extend(
                    _unknown_in(parser, _nested(key, value), "", classes, "--"))
    unknown = {where: mistakes for where, mistakes in unknown.items() if mistakes}
    if unknown:
        values = sum(mistake.is_value for mistakes in unknown.values() for mistake in mistakes)
        keys = sum(map(len, unknown.values())) - values
        counted = [f"{count} unknown {noun}{'s' if count > 1 else ''}"
                   for count, noun in ((keys, "key"), (values, "value")) if count]
        help_line = f"python -m lit_fsdp {command} --help lists the options"
        if keys + values == 1:  # one mistake: one line
            ((where, (mistake,)),) = unknown.items()
            place = "" if where == COMMAND_LINE else f"in {where}: "
            raise UnknownKeysError(f"{place}{mistake}; {help_line}")
        lines = [f"{' and '.join(counted)} ({help_line}):"]
        for where, mistakes in unknown.items():
            lines += [f"  in {where}:"] + [f"    {mistake}" for mistake in mistakes]
        raise UnknownKeysError("\n".join(lines))


def parse_error_line(error: Exception, command: str) -> str:
    """jsonargparse's error as one line: the option it is about, what is wrong, and where the options are listed
    (the usage it prints before an error is the length of a screen)."""
    text = str(error).strip()
    match = re.match(r'Parser key "([^"]+)":\s*(.*)', text, re.S)
    where, detail = (f"--{match[1]}: ", match[2]) if match else ("", text)
    return f"{where}{error_line(ValueError(detail))}; python -m lit_fsdp {command} --help lists the options"


def _read(name: str | None) -> Any:
    """A config file's content; None where it cannot be read (jsonargparse then says why)."""
    try:
        return yaml.safe_load(Path(name).read_text()) if name else None
    except (OSError, yaml.YAMLError):
        return None


def _nested(key: str, value: str | None) -> dict[str, Any]:
    """``a.b.c`` as ``{a: {b: {c: value}}}``: an option checked as a config's key is; a value written as a YAML
    mapping (``'{method: int8, num_bits: 4}'``) as that mapping, so its keys are checked too."""
    tree: dict[str, Any] = {}
    node = tree
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = _mapping(value) if value is not None and value.lstrip().startswith("{") else value
    return tree


def _mapping(value: str) -> Any:
    """A command line's ``{...}`` value as YAML reads it; the text itself where it is no YAML (jsonargparse then
    says why)."""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def _unknown_in(parser: ArgumentParser, content: dict[str, Any], prefix: str, classes: dict[str, str],
                shown: str = "") -> list[Mistake]:
    """Each key of ``content`` (under ``prefix``) ``parser`` does not take, as ``key: did you mean KEY?`` (``shown``
    before both: where ``parser`` sits in the whole config); the class a class-typed key holds (``class_path``) is
    remembered in ``classes``, for the configs after this one."""
    actions = {action.dest: action for action in parser._actions if action.dest and not action.dest.endswith(".help")}
    found = []
    for raw, value in content.items():
        if not isinstance(raw, str) or raw.startswith("__"):
            continue
        key = raw.rstrip("+")
        full = f"{prefix}{key}"
        if full in actions and getattr(actions[full], "_typehint", None) is not None:
            found += _unknown_in_value(actions[full], value, full, classes, shown)
        elif any(dest.startswith(f"{full}.") for dest in actions):  # a group: trainer, model
            if isinstance(value, dict):
                found += _unknown_in(parser, value, f"{full}.", classes, shown)
        elif full in actions:
            continue
        else:
            siblings = sorted({dest[len(prefix):].split(".")[0] for dest in actions if dest.startswith(prefix)}
                              - {"config", "print_config", "help"})
            near = difflib.get_close_matches(key, siblings, n=1, cutoff=0.8)
            found.append(Mistake(f"{shown}{full}: did you mean {shown}{prefix}{near[0]}?" if near else
                                 f"{shown}{full}: no such option" + (f" (options: {', '.join(siblings)})" if
                                                                      len(siblings) <= 6 else "")))
    return found


def _unknown_in_value(action: Any, value: Any, key: str, classes: dict[str, str], shown: str) -> list[Mistake]:
    """Unknown keys inside the value of a class-typed option (``trainer.strategy``, ``data``, ``model.lora``, each of
    ``trainer.callbacks``): checked against the class it names, or the one an earlier config or the default named;
    the value of an option of named choices (``sharding``), against them."""
    bases = _classes_in(getattr(action, "_typehint", None))
    if not bases:
        return _outside_choices(getattr(action, "_typehint", None), value, f"{shown}{key}")
    if isinstance(value, list):
        return [line for index, item in enumerate(value)
                for line in _unknown_in_class(bases, item, f"{shown}{key}[{index}]", None)]
    if isinstance(value, str) and not value.lstrip().startswith("{"):
        classes[key] = value
        return []
    if not isinstance(value, dict):
        return []
    if isinstance(value.get("class_path"), str):
        classes[key] = value["class_path"]
    return _unknown_in_class(bases, value, f"{shown}{key}", classes.get(key))


def _unknown_in_class(bases: list[type], value: Any, key: str, class_path: str | None) -> list[Mistake]:
    """Unknown keys of ``value``, a class's ``class_path``/``init_args`` dict (or a dataclass's fields) at ``key``."""
    if not isinstance(value, dict):
        return []
    class_path = value.get("class_path", class_path)
    target = _resolve(class_path, bases) if isinstance(class_path, str) else None
    if target is None:
        dataclasses = [base for base in bases if hasattr(base, "__dataclass_fields__")]
        if len(dataclasses) != 1 or "class_path" in value:
            return []  # a class jsonargparse resolves its own way: its error, if any, stands
        target = dataclasses[0]
    parser = _class_parser(target)
    if parser is None:
        return []
    arguments = {name: given for name, given in value.items() if name not in CLASS_KEYS}
    init_args = value.get("init_args") if isinstance(value.get("init_args"), dict) else {}
    found = _unknown_in(parser, init_args, "", {}, f"{key}.init_args.") + _unknown_in(parser, arguments, "", {},
                                                                                         f"{key}.")
    return [mistake if mistake.of else mistake._replace(of=f"{target.__module__}.{target.__qualname__}")
            for mistake in found]


def _outside_choices(typehint: Any, value: Any, key: str) -> list[Mistake]:
    """``value`` of an option typed with named choices alone (``Literal``, optionally ``Optional``) when it is none
    of them, with the nearest; an option that also takes another type (a number), and a value of any other type,
    are left to jsonargparse."""
    origin, arguments = typing.get_origin(typehint), typing.get_args(typehint)
    if origin is Literal:
        members = [typehint]
    elif origin in (typing.Union, types.UnionType):  # not a list of choices: a command line gives that as text
        members = [arg for arg in arguments if arg is not type(None)]
    else:
        return []
    if not members or any(typing.get_origin(member) is not Literal for member in members):
        return []
    choices = [choice for member in members for choice in typing.get_args(member)]
    if not isinstance(value, str) or not all(isinstance(choice, str) for choice in choices):
        return []
    if value in choices or (type(None) in arguments and value in ("null", "None")):
        return []
    near = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    listed = ", ".join(choices)
    return [Mistake(f"{key} {value}: did you mean {near[0]}? (choices: {listed})" if near else
                    f"{key} {value}: not one of {listed}", is_value=True)]


def _classes_in(typehint: Any) -> list[type]:
    """The classes (not builtins) a type hint names, through Optional, Union and list."""
    if inspect.isclass(typehint):
        return [] if typehint.__module__ in _PLAIN_MODULES else [typehint]
    return [found for argument in typing.get_args(typehint) for found in _classes_in(argument)]


def _resolve(class_path: str, bases: list[type]) -> type | None:
    """The class ``class_path`` names: a dotted import path, or a subclass's bare name (as jsonargparse takes it)."""
    module, _, name = class_path.rpartition(".")
    if module:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None
        return found if inspect.isclass(found) else None
    pending, seen = list(bases), set()
    while pending:
        candidate = pending.pop()
        if candidate in seen:
            continue
        seen.add(candidate)
        if candidate.__name__ == class_path:
            return candidate
        pending += candidate.__subclasses__()
    return None


@functools.lru_cache(maxsize=None)
def _class_parser(target: type) -> ArgumentParser | None:
    """A parser of ``target``'s constructor arguments as jsonargparse reads them; None where it cannot build one."""
    try:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(target, fail_untyped=False, sub_configs=True)
    except Exception:  # noqa: BLE001 -- a class jsonargparse cannot read is left to jsonargparse to report
        return None
    return parser


def _default_classes(parser: ArgumentParser) -> dict[str, str]:
    """The class each class-typed option holds by default (``data``: SyntheticDataModule), by its key."""
    classes = {}
    for action in parser._actions:
        default = getattr(action, "default", None)
        if isinstance(default, dict) and isinstance(default.get("class_path"), str):
            classes[action.dest] = default["class_path"]
        elif hasattr(default, "class_path") and isinstance(default.class_path, str):
            classes[action.dest] = default.class_path
    return classes
