"""Option fields that carry their own one-line help and, where the value is a name,
where its valid names come from.

Each options dataclass (``fullgraph.config``, a strategy's ``Options``) declares its
fields with ``option``; the command line (``--help``, ``choices``), config-file
validation and ``fullgraph config --print`` read the same metadata, so there is no
second list of help texts or valid names.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

Choices = Callable[[], Iterable[str]]


def option(default: Any, help: str, *, choices: Choices | Iterable[str] | None = None,
           or_else: tuple[str, ...] = ()) -> Any:
    """A dataclass field with ``default``, its one-line ``help`` and its valid names.

    Args:
        default: the default value.
        help: one line, lower case, no trailing period, without the default.
        choices: the valid values, or a function returning them (read lazily, from a
            registry) (default: None, any value of the field's type).
        or_else: the forms of the other values the field takes beside ``choices`` (as
            ``module:Class``); the dataclass validates those itself (default: none,
            ``choices`` only).
    """
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices,
                                                        "or_else": or_else})


def help_of(f: dataclasses.Field) -> str:
    """The help text of a field declared with ``option`` ("" otherwise)."""
    return str(f.metadata.get("help", ""))


def or_else_of(f: dataclasses.Field) -> tuple[str, ...]:
    """The forms of the values a field declared with ``option`` takes beside its choices
    (empty: its choices only)."""
    return tuple(f.metadata.get("or_else", ()))


def choices_of(f: dataclasses.Field) -> tuple[str, ...] | None:
    """The valid values of a field declared with ``option`` (None: any)."""
    choices = f.metadata.get("choices")
    if choices is None:
        return None
    return tuple(choices() if callable(choices) else choices)


def is_device_name(name: str, *, auto: bool = False) -> bool:
    """Whether ``name`` names a device an option may take: cpu, cuda or cuda:N (and
    ``auto`` where ``auto`` is True)."""
    return name in ("cpu", "cuda") or (auto and name == "auto") or (
        name.startswith("cuda:") and name[5:].isdigit())


def changed_fields(options: Any, among: Iterable[str] | None = None,
                   skip: Iterable[str] = ()) -> list[str]:
    """The names of the fields of the options dataclass ``options`` whose values differ
    from their defaults (only those ``among``, none in ``skip``), in field order."""
    keep = None if among is None else set(among)
    return [f.name for f in dataclasses.fields(options)
            if (keep is None or f.name in keep) and f.name not in skip
            and getattr(options, f.name) != f.default]


SEED_RANGE = "an integer in [0, 2**63)"
"""What every seed option takes (numpy's and torch's generators take 64-bit seeds;
negative ones are refused by numpy), as error messages say it."""


def is_seed(value: Any) -> bool:
    """Whether ``value`` is a seed an option may take: an int (not a bool) in [0, 2**63)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


TIMEOUT_MAX_S = 1e6
"""The longest timeout a run or a process group takes, in seconds (11 days): torch's
process groups overflow their clocks far beyond it."""
