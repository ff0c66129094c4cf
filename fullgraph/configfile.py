"""Config files in the command line's own names, and ``fullgraph config --print``.

A config file has one section per options dataclass (``[model]``, ``[partition]``,
``[data_parallel]`` ...) keyed by field name; flags are generated from the same
fields (``flag_names``). So that a user who knows the flags needs no second
vocabulary, a file may also name an option by its flag, without ``--`` (``-`` or
``_`` alike): at the top level (``dep-mode: hybrid``, ``model: gat``) or inside its
section (``[partition] partitioner = "g3"``). ``template`` writes every option with
its value, help and flag, as YAML or TOML that loads back to the same ``Config``.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from fullgraph.errors import ConfigError
from fullgraph.fields import choices_of, help_of, or_else_of

# core section field -> flag name, where the plain ``--field`` would be unclear; the
# strategies declare theirs (``Strategy.flags``, ``parallel.base.SHARED_FLAGS``)
FLAG_NAMES = {("model", "name"): "model", ("model", "options"): "model-options",
              ("launch", "timeout_s"): "timeout",
              ("adapt", "mode"): "adapt", ("adapt", "cache_budget_mb"): "cache-budget"}
RESERVED_FLAGS = ("config", "help", "version", "quiet")


def flags_of(section: str, fields: list[str]) -> str:
    """``--a, --b have`` / ``--a has``: options of ``section`` named by their flags, as
    the start of a sentence that says what they do."""
    names = flag_names()
    flags = ", ".join(f"--{names.get((section, f), f.replace('_', '-'))}" for f in fields)
    return f"{flags} {'has' if len(fields) == 1 else 'have'}"


def flag_names() -> dict[tuple[str, str], str]:
    """(section, field) -> flag, for every section. A strategy's flag that another
    section already uses is namespaced with its section (``--<section>-<field>``), so
    two strategies may both have, say, ``num_chunks``; earlier sections keep theirs."""
    from fullgraph.config import sections
    from fullgraph.parallel.base import section_flags

    declared = {(sec, f): flag for sec, flags in section_flags().items() for f, flag in
                flags.items()}
    declared.update(FLAG_NAMES)
    out: dict[tuple[str, str], str] = {}
    taken: set[str] = set(RESERVED_FLAGS)
    for section, cls in sections().items():
        for f in dataclasses.fields(cls):
            flag = declared.get((section, f.name), f.name.replace("_", "-"))
            if flag in taken:
                flag = f"{section.replace('_', '-')}-{f.name.replace('_', '-')}"
            if flag in taken:
                raise RuntimeError(f"flag --{flag} of {section}.{f.name} is taken twice")
            taken.add(flag)
            out[section, f.name] = flag
    return out


def _key(name: Any) -> str:
    return str(name).replace("_", "-")


def normalize(tree: Any, source: str) -> Any:
    """``tree`` with every option under its section and field name.

    Raises:
        ConfigError: an option is given twice (e.g. ``model.name`` and ``model``).
    """
    from fullgraph.config import sections

    if not isinstance(tree, dict):
        return tree  # config_from_dict refuses it
    known = sections()
    by_flag = {flag: where for where, flag in flag_names().items()}
    out: dict[str, Any] = {}
    seen: dict[tuple[str, str], str] = {}

    def put(section: str, name: str, value: Any, spelled: str) -> None:
        if (section, name) in seen:
            raise ConfigError(f"{source}: {section}.{name} is given twice (as "
                              f"{seen[section, name]!r} and {spelled!r})")
        seen[section, name] = spelled
        out.setdefault(section, {})[name] = value

    for top, value in tree.items():
        if top in known and value is None:  # a section whose keys are all commented out
            out.setdefault(top, {})
        elif top in known and isinstance(value, dict):
            fields = {f.name for f in dataclasses.fields(known[top])}
            out.setdefault(top, {})
            for key, inner in value.items():
                put(top, _field_name(top, key, fields, by_flag), inner, f"{top}.{key}")
        elif _key(top) in by_flag:
            put(*by_flag[_key(top)], value, str(top))
        elif _key(top) in ("quiet", "q"):  # --quiet's option: the log level it sets
            if not isinstance(value, bool):
                raise ConfigError(f"{source}: {top}: {value!r}; quiet takes true or false (or "
                                  "give log-level: warning, info or debug)")
            if value:  # (false: the level as it is)
                put("train", "log_level", "warning", str(top))
        else:
            out[top] = value  # config_from_dict names the unknown section
    return out


def _field_name(section: str, key: Any, fields: set[str],
                by_flag: dict[str, tuple[str, str]]) -> Any:
    """The field of ``section`` that ``key`` names: its name (``num_props``), that name
    dashed (``num-props``), or the option's flag (``dep-mode`` for ``mode``); else the
    key, which the section then refuses as unknown."""
    if key in fields:
        return key
    underscored = _key(key).replace("-", "_")
    if underscored in fields:
        return underscored
    alias = by_flag.get(_key(key))
    return alias[1] if alias is not None and alias[0] == section else key


def _yaml_value(value: Any) -> str:
    """``value`` as YAML that ``--config`` reads back as the same value: PyYAML writes
    YAML 1.1, whose plain ``1e3`` or ``007`` are text, and the file is read as YAML
    1.2, where they are numbers; such a text is quoted."""
    import yaml

    from fullgraph.config import yaml_load_unique

    text = yaml.safe_dump([value], default_flow_style=True).strip()[1:-1]
    if isinstance(value, str) and yaml_load_unique(f"[{text}]") != [value]:
        text = json.dumps(value)  # (a JSON string is a YAML double-quoted one)
    return text


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    # TOML takes any character but the controls (and DEL) as it is; json escapes those
    # as \uXXXX (a character above the BMP as a surrogate pair, which TOML refuses)
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def template(cfg: Any, fmt: str = "yaml") -> str:
    """Every option of ``cfg`` with its help and flag, as a YAML or TOML config file.

    Options that are unset (None) are written as ``null`` in YAML and commented out in
    TOML, which has no null; either loads back to ``cfg``.
    """
    from fullgraph.config import sections

    if fmt not in ("yaml", "toml"):
        raise ValueError(f"unknown config format {fmt!r}; expected yaml or toml")
    flags = flag_names()
    lines = [f"# fullgraph config ({fmt}): every option, with its flag; flags given on the",
             "# command line override this file. An option may also be named by its flag",
             "# (without --), at the top level or in its section.", ""]
    for section, cls in sections().items():
        lines.append(f"{section}:" if fmt == "yaml" else f"[{section}]")
        values = cfg.section(section)
        for f in dataclasses.fields(cls):
            choices, more = choices_of(f), or_else_of(f)
            extra = f"; one of {', '.join(choices)}" if choices else ""
            extra += f", or {' or '.join(more)}" if choices and more else ""
            lines.append(f"  # --{flags[section, f.name]}: {help_of(f)}{extra}"
                         if fmt == "yaml" else
                         f"# --{flags[section, f.name]}: {help_of(f)}{extra}")
            value = getattr(values, f.name)
            if fmt == "yaml":
                lines.append(f"  {f.name}: {_yaml_value(value)}")
            elif value is None:
                lines.append(f"# {f.name} = <value>   (unset; TOML has no null)")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
