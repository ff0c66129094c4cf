"""Models named by the user: a ``GNN`` subclass given as ``module:Class`` or
``path/to/file.py:Class``, resolved the same way in the launcher, every worker, the
planner and ``load_model``.

A model is its class plus the options the run records, so a run, a checkpoint and a
saved model name the class by a reference that another process can import: the
built-in names (``gcn``, ...), ``package.module:Class`` (imported from ``sys.path``;
the working directory is put on it, as ``python -m`` does, because the ``fullgraph``
command's own directory is not where a user's modules live), or a Python file by
path (kept absolute, so a worker or a later ``--resume`` finds it from any
directory). A file is imported under a private module name, never as ``__main__``,
with its directory put on ``sys.path`` (as ``python file.py`` does, for the modules
beside it): a script that both defines a model and calls ``fullgraph.fit`` runs its
``if __name__ == "__main__":`` part once, in the process the user started. A class
of such a file is named by the file again (``reference_of``).

A class handed over as an object (``fit(model=MyGNN)``) is kept in this process's
table under its reference, so the calling process never imports it again. One
defined where no other process can import it (a notebook cell, a function) is named
``__main__:Class``: it trains in the calling process (``workers=1``), and a
distributed run refuses it before any worker starts, with the fix.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fullgraph.errors import ConfigError

if TYPE_CHECKING:
    from fullgraph.models.base import GNN

REFERENCE = "module:Class or path/to/file.py:Class (a fullgraph.models.GNN subclass)"
"""How error messages and ``--help`` describe a user's model reference."""

_known: dict[str, type] = {}  # reference -> class, for the classes reference_of named
_files: dict[str, Path] = {}  # private module name -> the model file it was loaded from
_only_here: set[str] = set()  # those of them that no other process can import
_importing = threading.local()
_digests: dict[str, str] = {}  # private module name -> digest of the source it ran
_loading = threading.RLock()  # one import of a model file at a time (a file may load another)


def importing_model_file() -> str | None:
    """The model file (or module) being imported now by ``resolve`` in this thread
    (None: none): ``fullgraph.fit`` refuses to start a run from inside it."""
    return getattr(_importing, "path", None)


def is_reference(name: str) -> bool:
    """Whether ``name`` has the form of a user's model reference (``target:Class``)."""
    target, sep, attr = name.rpartition(":")
    return bool(sep and target and attr)


def reference_of(cls: type) -> str:
    """The name under which ``cls`` (a ``GNN`` subclass) is recorded: its built-in name,
    ``module:Class`` (``pkg.script:Class`` for a class of a script run as ``python -m
    pkg.script``), ``/abs/file.py:Class`` for a class of the script that is running, or
    ``__main__:Class`` (this process only) for one that has no file."""
    from fullgraph.models import MODELS

    _check_class(cls, repr(cls))
    for name, builtin in MODELS.items():
        if cls is builtin:
            return name
    module, qualname = cls.__module__, cls.__qualname__
    if module in _files:  # loaded from a file by resolve: named by the file again
        return f"{_files[module]}:{qualname}"
    spec = getattr(sys.modules.get("__main__"), "__spec__", None) \
        if module == "__main__" else None
    if spec is not None and spec.parent and "<locals>" not in qualname:
        # a script run as ``python -m pkg.script``: the workers import it by that name
        # (as its relative imports need), and its ``__main__`` guard keeps it from running
        ref = f"{spec.name}:{qualname}"
        _known[ref] = cls
        return ref
    path = getattr(sys.modules.get("__main__"), "__file__", None) \
        if module == "__main__" else None
    if "<locals>" in qualname or module not in sys.modules or (
            module == "__main__" and not (path and Path(path).suffix == ".py")):
        ref = f"{module}:{qualname}"
        _only_here.add(ref)
    elif path:  # this process uses the class it has; a worker imports the file
        ref = f"{Path(path).resolve()}:{qualname}"
    else:
        ref = f"{module}:{qualname}"
    _known[ref] = cls
    return ref


def family(cls: type) -> str | None:
    """The name of the built-in model ``cls`` is or derives from (None: neither)."""
    from fullgraph.models import MODELS

    return next((name for name, builtin in MODELS.items() if issubclass(cls, builtin)), None)


def canonical(name: str) -> str:
    """``name`` as a run records it: a file reference with its path made absolute
    (every other name unchanged)."""
    target, _, attr = name.rpartition(":")
    if is_reference(name) and _is_file(target):
        return f"{Path(target).expanduser().resolve()}:{attr}"
    return name


def resolve(name: str) -> type[GNN]:
    """The model class ``name`` names: a built-in model or a user's reference.

    Raises:
        ConfigError: naming what is wrong: an unknown name, a module or file that is
            missing or fails to import, a missing attribute, or not a ``GNN``
            subclass.
    """
    from fullgraph.models import MODELS

    if name in MODELS:
        return MODELS[name]
    if name in _known:
        return _known[name]
    if not is_reference(name):
        raise ConfigError(f"unknown model {name!r}; expected one of {', '.join(MODELS)} "
                          f"or {REFERENCE}")
    _paths_from_launcher()  # (a worker: its launcher's sys.path, in its order)
    target, _, attr = name.rpartition(":")
    here = getattr(sys.modules.get("__main__"), attr, None) if target == "__main__" else None
    if here is not None and isinstance(here, type) and here.__module__ == "__main__":
        _check_class(here, f"model {name}")  # defined again in this process's __main__
        return here  # (a notebook that saved a model of its own class, run again)
    if target == "__main__" or "<locals>" in attr:
        raise _unimportable(name)
    module = _load_file(target, name) if _is_file(target) else _import(target, name)
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"model {name}: {target} has no attribute {part!r}")
        obj = getattr(obj, part)
    _check_class(obj, f"model {name}")
    assert isinstance(obj, type)
    return obj


def for_workers(name: str) -> dict[str, str]:
    """The environment that lets launched workers import the model ``name`` as this
    process did: for a module reference, ``PYTHONPATH`` with the directory this
    process found its top-level package in (a script's own directory is on this
    process's ``sys.path``, and not on theirs), and for a module or a file the other
    directories this process put on its ``sys.path`` (``_with_paths``); nothing for a
    built-in.

    Raises:
        ConfigError: the class lives in this process only (a notebook's or a
            function's): no worker can import it.
    """
    if name in _only_here or name.startswith("__main__:"):
        raise _unimportable(name)
    target = name.rpartition(":")[0]
    if not is_reference(name):
        return {}
    if _is_file(target):
        return _with_paths({})
    resolve(name)  # imported here first, so its top-level package is known
    top_name = target.split(".")[0]
    top = sys.modules.get(top_name) or _import(top_name, name)  # (a class known here
    # by reference_of, whose module was dropped from sys.modules since, is found anew)
    file, found = getattr(top, "__file__", None), list(getattr(top, "__path__", []))
    if file:  # a module's directory, or the one that holds the package's directory
        where = Path(file).parent.parent if Path(file).stem == "__init__" else \
            Path(file).parent
    elif found:  # a namespace package: its first portion's parent
        where = Path(found[0]).parent
    else:
        return {}
    return _with_paths({"PYTHONPATH": str(where.resolve())})


PATH_AFTER_ENV = "FULLGRAPH_PATH_AFTER"
"""The directories a launcher's ``sys.path`` has after the interpreter's own, which its
workers append to theirs (``PYTHONPATH`` would put them first)."""


def _with_paths(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the directories this process added to its ``sys.path`` (a
    notebook's ``sys.path.insert`` or ``append``, a script's own directory), in their
    places: those before the interpreter's own directories (its prefix,
    site-packages) on ``PYTHONPATH``, those after them in ``PATH_AFTER_ENV``, which
    ``resolve`` appends to the worker's ``sys.path``. The model's module may import
    from them, as a spawned ``multiprocessing`` child could."""
    import site
    import sysconfig

    ours = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    ours |= {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages(),
                                          *sysconfig.get_paths().values()]}
    before = [env["PYTHONPATH"]] if "PYTHONPATH" in env else []
    after: list[str] = []
    seen_ours = False
    for entry in sys.path:
        where = Path(entry or os.getcwd()).resolve()
        if any(where == p or p in where.parents for p in ours):
            seen_ours = True
        elif where.is_dir() and str(where) not in before + after:
            (after if seen_ours else before).append(str(where))
    given = os.environ.get("PYTHONPATH")
    if given:
        before.append(given)
    out = {"PYTHONPATH": os.pathsep.join(before)} if before else {}
    return out | ({PATH_AFTER_ENV: os.pathsep.join(after)} if after else {})


def _paths_from_launcher() -> None:
    """Append to ``sys.path`` the directories the launching process had after the
    interpreter's own (``_with_paths``), once."""
    for entry in os.environ.get(PATH_AFTER_ENV, "").split(os.pathsep):
        if entry and entry not in sys.path:
            sys.path.append(entry)


def parse_options(text: str) -> dict[str, Any]:
    """``key=value,key=value`` as keyword options; a value is read as JSON where it is
    JSON (``0.1``, ``true``, ``null``, ``"a,b"``, ``[1, 2]``), else kept as the text
    up to the next comma.

    Raises:
        ConfigError: an item without ``=`` or a name, a key given twice, or a quoted
            or bracketed value that does not close.
    """
    out: dict[str, Any] = {}
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(text):
        comma, equals = text.find(",", pos), text.find("=", pos)
        if comma == pos or not text[pos:comma if comma >= 0 else None].strip():
            pos = len(text) if comma < 0 else comma + 1  # an empty item
            continue
        key = text[pos:equals].strip() if equals >= 0 else ""
        if equals < 0 or 0 <= comma < equals or not key.isidentifier():
            item = text[pos:comma if comma >= 0 else None].strip()
            raise ConfigError(f"model.options: {item!r} is not key=value (a Python name, "
                              "then =, then the value)")
        if key in out:
            raise ConfigError(f"model.options: {key!r} is given twice")
        start = equals + 1
        while start < len(text) and text[start].isspace():
            start += 1
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            value, end = None, -1
        rest = text[end:] if end >= 0 else ""
        if end >= 0 and (not rest.strip() or rest.lstrip().startswith(",")):
            out[key] = value
            pos = end + len(rest) - len(rest.lstrip()) + 1
        elif text[start:start + 1] in ('"', "[", "{"):
            raise ConfigError(f"model.options: the value of {key!r} opens with "
                              f"{text[start]} but is not JSON (an unclosed quote or "
                              "bracket?)")
        else:
            stop = text.find(",", start)
            out[key] = text[start:stop if stop >= 0 else None].strip()
            pos = len(text) if stop < 0 else stop + 1
    return out


def format_options(options: dict[str, Any], where: str = "model_options") -> str:
    """``options`` in the form ``parse_options`` reads back (values as JSON).

    Raises:
        ConfigError: a value JSON cannot write (naming ``where`` and its key).
    """
    out = []
    for key, value in options.items():
        try:
            out.append(f"{key}={json.dumps(value)}")
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: the value of {key!r} (of type "
                              f"{type(value).__name__}) is no option value; expected a "
                              "number, text, bool, None, or a list or mapping of those") \
                from None
    return ",".join(out)


def check_options(cls: type, options: dict[str, Any], name: str,
                  flagged: Iterable[str] = ()) -> None:
    """Refuse an option the model class ``cls`` does not take: one its ``__init__``
    names, or that its ``conv()`` reads (``GNN.conv_option_names``); the options every
    model has are flags of their own (``--hidden``, ``--dropout``, ...), and so are
    those named in ``flagged`` (``--heads``, ...).

    Raises:
        ConfigError: naming the option and what the class takes.
    """
    general, named = _option_parameters(cls)
    taken = ({p.name for p in named} | set(getattr(cls, "conv_option_names", ()))) - \
        general - set(flagged)
    for p in named:
        if p.default is p.empty and p.name in taken and p.name not in options:
            raise ConfigError(f"model.options: model {name} needs option {p.name!r} "
                              f"(--model-options {p.name}=VALUE)")
    for key in options:
        if key in general:
            raise ConfigError(f"model.options: {key!r} is an option of every model: give it "
                              "as its own flag (--hidden, --layers, --dropout, ...)")
        if key not in taken:
            offer = ", ".join(sorted(taken)) or "none"
            raise ConfigError(f"model.options: model {name} takes no option {key!r} (it "
                              f"takes: {offer}; a GNN subclass declares what its conv() "
                              "reads in conv_option_names)")


def _option_parameters(cls: type) -> tuple[set[str], list[inspect.Parameter]]:
    """The options every model takes (``GNN.__init__``'s), and the keyword parameters
    of ``cls``'s own ``__init__`` chain below ``GNN``."""
    from fullgraph.models.base import GNN

    general = set(inspect.signature(GNN.__init__).parameters) - {"self", "conv_options"}
    named = [p for klass in cls.__mro__[:cls.__mro__.index(GNN)]
             for p in inspect.signature(klass).parameters.values()
             if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return general, named


def unknown_options(cls: type, options: Iterable[str]) -> list[str]:
    """The names in ``options`` that model class ``cls`` neither takes nor reads (a
    saved model's, written by another version, say)."""
    general, named = _option_parameters(cls)
    known = general | {p.name for p in named} | set(getattr(cls, "conv_option_names", ()))
    return sorted(set(options) - known)


def _unimportable(name: str) -> ConfigError:
    return ConfigError(
        f"model {name}: the class was defined in the calling process (a notebook cell "
        "or a function), which the workers cannot import; move it to a module or a .py "
        "file, or train it with workers=1")


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _check_class(obj: object, where: str) -> None:
    from fullgraph.models.base import GNN

    if not (isinstance(obj, type) and issubclass(obj, GNN)):
        what = obj.__name__ if isinstance(obj, type) else type(obj).__name__
        raise ConfigError(f"{where}: {what} is not a subclass of fullgraph.models.GNN "
                          "(a model is a GNN whose conv() returns its stages)")


def _import(module: str, name: str):
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    # (a script run as ``python -m pkg.script`` is imported so: one that trains when
    # imported must be refused, not start workers of its own)
    outer, _importing.path = getattr(_importing, "path", None), module
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise ConfigError(f"model {name}: no module named {exc.name!r} (looked in the "
                              "working directory and on sys.path)") from None
        raise ConfigError(f"model {name}: importing {module} failed: {exc}") from exc
    except Exception as exc:
        raise ConfigError(f"model {name}: importing {module} failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    finally:
        _importing.path = outer


def _load_file(target: str, name: str):
    """The module of the model file ``target``, run again where its source changed since
    it last ran here (a notebook that edits the file trains the new class, as launched
    workers, which import it afresh, do)."""
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"model {name}: {path} is not a file")
    try:
        source = path.read_bytes()
        digest = hashlib.sha1(source).hexdigest()
    except OSError as exc:
        raise ConfigError(f"model {name}: {path} cannot be read: {exc}") from None
    key = "fullgraph_model_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    with _loading:
        if key in sys.modules and _digests.get(key) == digest:
            return sys.modules[key]
        spec = importlib.util.spec_from_file_location(key, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"model {name}: {path} cannot be imported as Python")
        module = importlib.util.module_from_spec(spec)
        before = sys.modules.get(key)  # the file's earlier run, kept if this one fails
        sys.modules[key] = module  # dataclasses and pickling look classes up by module
        _files[key] = path
        if str(path.parent) not in sys.path:  # its own imports, as `python file.py` finds them
            sys.path.insert(0, str(path.parent))
        outer, _importing.path = getattr(_importing, "path", None), str(path)
        try:
            # the bytes digested, compiled here: the import system's cached bytecode is
            # reused for an edit of the same size within the same second
            exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102
        except BaseException as exc:  # SystemExit too: no half-run module is kept
            if before is None:
                del sys.modules[key], _files[key]
            else:
                sys.modules[key] = before
            if not isinstance(exc, Exception):
                raise
            raise ConfigError(f"model {name}: importing {path} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        finally:
            _importing.path = outer
        _digests[key] = digest
        return module


__all__ = ["REFERENCE", "canonical", "check_options", "family", "for_workers", "format_options",
           "importing_model_file", "is_reference", "parse_options", "reference_of", "resolve"]
