"""Unknown keys in ``fit``/``validate`` config files and options, all found before LightningCLI parses, each with
the nearest valid key: jsonargparse stops at the first and prints its whole usage first."""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentParser

from lit_fsdp.errors import ErrorBlock, error_line

#: Keys every class-typed value takes besides its class's arguments.
CLASS_KEYS = ("class_path", "init_args", "dict_kwargs")
#: Types whose values hold no keys to check.
_PLAIN_MODULES = ("builtins", "typing", "collections.abc", "pathlib", "datetime", "types")


class UnknownKeysError(ErrorBlock):
    """Config keys (or options) no parser takes: a short block, one line per key, shown whole."""


def check(parser: ArgumentParser, args: list[str], command: str) -> None:
    """Raise ``UnknownKeysError`` naming every key of every ``--config`` file in ``args`` (and every ``--a.b`` option)
    that ``parser`` (``command``'s) does not take, with the nearest one that it does."""
    classes = _default_classes(parser)
    unknown: dict[str, list[str]] = {}
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
                unknown.setdefault("the command line", []).extend(
                    _unknown_in(parser, _nested(key, value), "", classes, "--"))
    unknown = {where: keys for where, keys in unknown.items() if keys}
    if unknown:
        count = sum(map(len, unknown.values()))
        lines = [f"{count} unknown key{'s' if count > 1 else ''} (python -m lit_fsdp {command} --help lists the "
                 "options):"]
        for where, keys in unknown.items():
            lines += [f"  in {where}:"] + [f"    {key}" for key in keys]
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
    """``a.b.c`` as ``{a: {b: {c: value}}}``: an option checked as a config's key is."""
    tree: dict[str, Any] = {}
    node = tree
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return tree


def _unknown_in(parser: ArgumentParser, content: dict[str, Any], prefix: str, classes: dict[str, str],
                shown: str = "") -> list[str]:
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
            found.append(f"{shown}{full}: did you mean {shown}{prefix}{near[0]}?" if near else
                         f"{shown}{full}: no such option" + (f" (options: {', '.join(siblings)})" if
                                                              len(siblings) <= 6 else ""))
    return found


def _unknown_in_value(action: Any, value: Any, key: str, classes: dict[str, str], shown: str) -> list[str]:
    """Unknown keys inside the value of a class-typed option (``trainer.strategy``, ``data``, ``model.lora``, each of
    ``trainer.callbacks``): checked against the class it names, or the one an earlier config or the default named."""
    bases = _classes_in(getattr(action, "_typehint", None))
    if not bases:
        return []
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


def _unknown_in_class(bases: list[type], value: Any, key: str, class_path: str | None) -> list[str]:
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
    return [f"{line} (of {target.__module__}.{target.__qualname__})" for line in found]


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
