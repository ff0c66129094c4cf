"""Packaging: what a plain ``pip install`` brings, and what the README and CI say of it.

The install itself (build the wheel, install it into a fresh venv, run the main
command) is ``make install-check``, which ``.ci/run`` calls outside pytest.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import fullgraph
from fullgraph.extras import EXTRAS, MissingExtraError, require

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
IMPORT_NAME = {"pyyaml": "yaml"}  # distribution -> module, where they differ


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("-", "_")


def _readme() -> str:
    return " ".join((REPO / "README.md").read_text().split())


def test_declared_dependencies_are_imported() -> None:
    source = "\n".join(p.read_text() for p in (REPO / "fullgraph").rglob("*.py"))
    for requirement in PROJECT["dependencies"]:
        module = IMPORT_NAME.get(_name(requirement), _name(requirement))
        assert re.search(rf"^\s*(import|from) {module}\b", source, re.MULTILINE), \
            f"{requirement} is declared but fullgraph never imports {module}"


def test_the_default_partitioner_is_a_required_dependency() -> None:
    assert "pymetis" in {_name(r) for r in PROJECT["dependencies"]}


@pytest.mark.parametrize("module,extra", sorted(EXTRAS.items()))
def test_every_optional_module_has_its_extra(module: str, extra: str) -> None:
    assert module in {_name(r) for r in PROJECT["optional-dependencies"][extra]}


@pytest.mark.parametrize("module,extra", sorted(EXTRAS.items()))
def test_missing_optional_module_is_one_line_naming_the_extra(monkeypatch, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # importing it now fails
    with pytest.raises(MissingExtraError) as err:
        require(module, "this feature")
    assert str(err.value) == (f"this feature needs {module}, which is not installed: "
                              f"pip install 'fullgraph[{extra}]'")
    assert isinstance(err.value, ImportError)


def test_to_pyg_without_torch_geometric_names_the_extra(monkeypatch) -> None:
    from fullgraph.graph import synthetic
    from fullgraph.graph.formats.pyg import to_pyg

    monkeypatch.setitem(sys.modules, "torch_geometric", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'fullgraph\[pyg\]'"):
        to_pyg(synthetic.sbm(20, 2, num_features=3))


def test_version_is_the_package_version() -> None:
    assert PROJECT["version"] == fullgraph.__version__


def test_readme_states_the_tested_torch_range_and_the_cpu_route() -> None:
    torch = [r for r in PROJECT["dependencies"] if _name(r) == "torch"]
    assert torch == ["torch>=2.13,<2.14"]
    readme = _readme()
    assert "torch>=2.13,<2.14" in readme
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in readme


def test_readme_main_command_is_the_one_make_and_ci_run() -> None:
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    main = " ".join(re.search(r"^MAIN := (.*)$", makefile, re.MULTILINE).group(1).split())
    assert f"fullgraph {main}" in _readme()
    assert "$(VENV)/bin/fullgraph $(MAIN)" in makefile
    assert ".ci/install-check $(PYTHON) $(VENV)/bin/pip -- $(MAIN)" in makefile


def test_ci_installs_the_wheel_and_runs_the_readme_test_command() -> None:
    steps = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert "make install-check" in steps and "make test" in steps
    assert re.search(r"^make test +# runs the whole test suite", (REPO / "README.md").read_text(),
                     re.MULTILINE)


def test_make_and_ci_install_the_cpu_build_of_torch() -> None:
    """A local +cpu wheel where pip finds one, else PyTorch's CPU index: never PyPI's
    Linux wheel, the CUDA build."""
    for path in (REPO / "Makefile", REPO / ".ci" / "install-check"):
        text = path.read_text()
        assert "install --quiet torch==2.13.0+cpu" in text or \
            "install torch==2.13.0+cpu" in text, path
        assert "--index-url" in text and "download.pytorch.org/whl/cpu" in text, path
