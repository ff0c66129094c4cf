"""Package metadata and the README's opening claim only the strategies that exist."""
from __future__ import annotations

import re
from pathlib import Path

import fullgraph
from fullgraph.parallel import STRATEGIES

REPO = Path(__file__).resolve().parents[1]
# the kind of parallelism a text may claim -> the strategy that implements it
KINDS = {"data": "data", "tensor": "tensor", "hybrid": "p2p", "task": "task"}


def _claimed(text: str) -> set[str]:
    """Kinds named before 'parallelism' in its clause (e.g. 'x: data, tensor and hybrid')."""
    kinds: set[str] = set()
    for clause in re.findall(r"([^:.;]*)\bparallelism", " ".join(text.split())):
        kinds |= {k for k in KINDS if re.search(rf"\b{k}\b", clause, re.IGNORECASE)}
    return kinds


def _pyproject_description() -> str:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    return re.search(r'^description = "(.*)"$', text, re.MULTILINE).group(1)


def test_claim_parser_sees_every_kind() -> None:
    assert _claimed("workers: data, tensor, task and\nhybrid parallelism") == set(KINDS)
    assert _claimed("Runs: data and tensor parallelism. Task is not") == {"data", "tensor"}


def test_package_metadata_claims_only_built_strategies() -> None:
    for where, text in (("pyproject.toml", _pyproject_description()),
                        ("fullgraph/__init__.py", fullgraph.__doc__)):
        claimed = _claimed(text)
        assert claimed, f"{where} names no kind of parallelism"
        missing = {k for k in claimed if KINDS[k] not in STRATEGIES}
        assert not missing, f"{where} claims {sorted(missing)} parallelism, not built"


def test_readme_says_unbuilt_parts_are_planned() -> None:
    first = (REPO / "README.md").read_text(encoding="utf-8").split("\n\n")[1]
    sentences = re.split(r"(?<=\.)\s+", " ".join(first.split()))
    import importlib.util

    for name, built in (("task parallelism", "task" in STRATEGIES),
                        ("resource-aware runtime",
                         importlib.util.find_spec("fullgraph.adapt") is not None)):
        mentions = [s for s in sentences if name in s]
        assert mentions, f"README's first paragraph does not mention {name}"
        if not built:
            assert all("planned" in s.lower() for s in mentions), mentions
