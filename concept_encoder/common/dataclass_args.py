"""Typed dataclass arguments from the command line and a YAML file: transformers' `HfArgumentParser`, plus
what it lacks (why hand-written): YAML values checked against the declared types (`max_steps: 3.7` must not become
3), a key given twice is an error, a repeatable list flag (`--gate a --gate b`), rules between the classes of a set,
defaults that depend on other arguments, and `to_argv`, the flags that rebuild a parse.

Torch-free: the plan checker parses the loops' flags with this very parser.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

import yaml
from transformers import HfArgumentParser


class ArgumentSet(tuple):
    """The dataclasses one script parses together (a tuple of classes, as `HfArgumentParser` takes them), with
    the set's own `rule`: called with one parsed instance per class, after each class's `__post_init__`, it checks
    what involves several classes (ValueError) and may resolve defaults that depend on them (`resolve_default`);
    `repeatable` names the list flags that may be given more than once."""

    def __new__(cls, classes, rule: Callable[..., None] | None = None, repeatable: tuple[str, ...] = ()):
        instance = super().__new__(cls, classes)
        instance.rule, instance.repeatable = rule, repeatable
        return instance


def imply_defaults(instances, values: dict) -> None:
    """Record that another argument of the set (a recipe) made `values` the defaults of these fields: `to_argv` then
    names a field only where it differs from them (the other argument, named too, brings them back)."""
    for instance in instances:
        names = {f.name for f in fields(instance)}
        instance.__dict__.setdefault("_implied_defaults", {}).update({k: v for k, v in values.items() if k in names})


def resolve_default(instance, name: str, value) -> None:
    """Set a default that depends on other arguments, and remember it was not given (`to_argv` leaves it out)."""
    setattr(instance, name, value)
    instance.__dict__.setdefault("_resolved_defaults", set()).add(name)


def build_parser(classes, **kwargs) -> HfArgumentParser:
    """The parser of `classes`: one flag per dataclass field (what `loops/mlm.py --help` lists), plus `--config`."""
    parser = HfArgumentParser(classes, **kwargs)
    parser.add_argument("--config", default=None, help="YAML file of arguments; command-line flags override it")
    return parser


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (the plain loader keeps
    the last value silently: `learning_rate` twice in a config would train with whichever came second)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}: give each setting once", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml_mapping(path: str | Path, what: str) -> dict:
    """A YAML file that must hold a mapping; ValueError naming `what` and the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path}: no such file")
    try:
        values = yaml.load(path.read_text(), Loader=UniqueKeyLoader) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"{what} {path}: not valid YAML ({error})") from error
    if not isinstance(values, dict):
        raise ValueError(f"{what} {path}: expected a mapping of names to values")
    return values


def read_argument_file(path: str | Path, classes, what: str = "--config") -> dict:
    """A YAML mapping of argument names to values; unknown names are an error naming the valid ones."""
    values = read_yaml_mapping(path, what)
    check_argument_names(values, classes, f"{what} {path}")
    return values


def check_argument_names(values: dict, classes, where: str) -> None:
    valid = {f.name for cls in classes for f in fields(cls)}
    unknown = sorted(set(values) - valid)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; valid keys are {sorted(valid)}")


def parse_dataclasses(argv: list[str] | None, classes, defaults: dict | None = None) -> tuple:
    """Parse `argv` (default `sys.argv[1:]`) into one instance of each dataclass in `classes`, then apply the
    set's rule (`ArgumentSet.rule`). Precedence, lowest first: the dataclass defaults, `defaults`, the `--config`
    YAML file, the command-line flags. Unknown flags or keys raise `ValueError`; so does any value a dataclass's
    `__post_init__` rejects. A malformed value (`--max_steps x`) is argparse's usage error (exit code 2)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    known, rest = pre.parse_known_args(merge_repeated_lists(argv, getattr(classes, "repeatable", ())))
    parser = build_parser(classes)
    if defaults:
        check_argument_names(defaults, classes, "defaults")
        parser.set_defaults(**defaults)
    config = read_argument_file(known.config, classes) if known.config else {}
    parser.set_defaults(**config)
    namespace, unknown = parser.parse_known_args(rest)
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; run with --help for the valid flags")
    values = vars(namespace)
    parsed = tuple(
        cls(**{f.name: typed_value(cls, f.name, values[f.name]) for f in fields(cls) if f.init}) for cls in classes
    )
    given = flag_names(parser, rest) | set(config)
    for instance in parsed:
        instance.__dict__["_given"] = given & {f.name for f in fields(instance)}
    if getattr(classes, "rule", None) is not None:
        classes.rule(*parsed)
    return parsed


def flag_names(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The field names `argv`'s flags set, as `parser` reads them (`--name value`, `--name=value`, an abbreviation,
    `--no_name`): parsed over a namespace whose every field holds a sentinel, which argparse leaves where no flag
    wrote (it fills only the fields a namespace lacks with their defaults)."""
    unset = object()
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS})
    parsed, _ = parser.parse_known_args(argv, namespace=namespace)
    return {name for name, value in vars(parsed).items() if value is not unset}


def given_fields(instance) -> set[str]:
    """The fields of a parsed `instance` set by a flag or a `--config` key, not by a default of any level (a
    dataclass's, a profile's, a recipe's): what the rules may call a user's choice."""
    return instance.__dict__.get("_given", set())


def merge_repeated_lists(argv: list[str], repeatable: tuple[str, ...]) -> list[str]:
    """`argv` with the occurrences of each `repeatable` list flag merged into one (argparse would keep the last):
    `--gate a --gate b` means `--gate a b`."""
    merged: dict[str, list[str]] = {}
    rest: list[str] = []
    flag = None
    for token in argv:
        if token in repeatable:
            flag = token
            merged.setdefault(token, [])
        elif flag is not None and not token.startswith("--"):
            merged[flag].append(token)
        else:
            flag = None
            rest.append(token)
    return rest + [item for name, values in merged.items() for item in (name, *values)]


def typed_value(cls, name: str, value):
    """`value` as the type `cls.name` declares, or ValueError: YAML and profile values reach the
    dataclasses without argparse's conversion, and `max_steps: 3.7` must not become 3 silently."""
    declared = get_type_hints(cls)[name]
    if get_origin(declared) is list:  # a list of strings: a YAML list, one YAML string, or the CLI's list
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(item, str) for item in items):
            raise ValueError(f"{name}={value!r} must be a string or a list of strings")
        return list(items)
    allowed = [t for t in get_args(declared) if t is not type(None)] or [declared]
    if value is None and type(None) in get_args(declared):
        return None
    for kind in allowed:
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):  # no setting means infinity or NaN; NaN would pass every range check
                raise ValueError(f"{name}={value!r} must be a finite number")
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind in (str, bool) and isinstance(value, kind):
            return value
    wanted = " or ".join(getattr(kind, "__name__", str(kind)) for kind in allowed)
    raise ValueError(f"{name}={value!r} must be {'an' if wanted[0] in 'aeiou' else 'a'} {wanted}")


def field_default(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def to_argv(*instances) -> list[str]:
    """The command-line flags that make `parse_args` rebuild `instances`: one per non-default field.

    `parse_args(to_argv(*parse_args(argv)))` equals `parse_args(argv)` (tested).
    """
    argv: list[str] = []
    for instance in instances:
        resolved = instance.__dict__.get("_resolved_defaults", set())
        implied = instance.__dict__.get("_implied_defaults", {})
        for f in fields(instance):
            value = getattr(instance, f.name)
            if not f.init or value == implied.get(f.name, field_default(f)) or f.name in resolved:
                continue
            if isinstance(value, list):
                argv += [f"--{f.name}", *value]
            else:
                argv += [f"--{f.name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv
