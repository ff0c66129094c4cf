"""Fixtures shared by the whole test suite."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DEVICE_ENV = "FULLGRAPH_TEST_DEVICE"  # devices.ENV; devices is imported after it is set


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default=None,
                     help=f"device of the kernel, model and exactness tests: cpu, cuda or "
                          f"cuda:N (sets {DEVICE_ENV}; default: that variable, else cpu)")


def pytest_configure(config: pytest.Config) -> None:
    """Measured kernel choices (``fullgraph.ops.select``) go to a cache of this session,
    not the user's, and are made once, here, so every process of the session (worker
    ranks and launched CLI runs inherit the variable) reads the same choice.

    ``--device`` sets ``FULLGRAPH_TEST_DEVICE`` (rank processes inherit it); a CUDA
    device that this machine cannot give stops the session here, rather than letting
    the suite pass on the CPU unnoticed."""
    if config.getoption("--device"):
        os.environ[DEVICE_ENV] = config.getoption("--device")
    device = os.environ.get(DEVICE_ENV, "cpu") or "cpu"
    _check_test_device(device)
    if device == "cpu":
        # the GPU kernels' tests (tests/ops/test_gpu_kernels.py) run through Triton's
        # interpreter here, which Triton reads when it is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if "FULLGRAPH_CACHE_DIR" not in os.environ:
        import tempfile

        os.environ["FULLGRAPH_CACHE_DIR"] = tempfile.mkdtemp(prefix="fullgraph-test-cache-")
    from fullgraph.ops.select import choose

    choose()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tell ``harness.run_ranks`` whether the test about to run (its fixtures too) is
    marked ``dist``: one that starts ranks unmarked fails, so ``-m "not dist"`` stays
    the quick part docs/contributing.md says it is."""
    import harness

    harness.DIST_MARKED = item.get_closest_marker("dist") is not None


def _check_test_device(name: str) -> None:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as err:
        pytest.exit(f"{DEVICE_ENV}={name!r}: {err}", returncode=4)
    if device.type == "cpu":
        return
    if device.type != "cuda":
        pytest.exit(f"{DEVICE_ENV}={name!r}: expected cpu, cuda or cuda:N", returncode=4)
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "no CUDA device is visible")
        pytest.exit(f"{DEVICE_ENV}={name!r} but {why} (torch {torch.__version__}); "
                    f"run with {DEVICE_ENV}=cpu or on a machine with a GPU", returncode=4)
    if device.index is not None and device.index >= torch.cuda.device_count():
        pytest.exit(f"{DEVICE_ENV}={name!r} but only {torch.cuda.device_count()} CUDA "
                    f"device(s) are visible", returncode=4)


@pytest.fixture(scope="session")
def shared_datasets() -> Path:
    """The offline real datasets (``<repo>/../shared/datasets``); skips when absent.

    The environment variable ``FULLGRAPH_SHARED_DATASETS`` overrides the location.
    """
    override = os.environ.get("FULLGRAPH_SHARED_DATASETS")
    path = Path(override) if override else (REPO_ROOT / ".." / "shared" / "datasets").resolve()
    if not path.is_dir():
        pytest.skip(f"shared datasets not found at {path} (set FULLGRAPH_SHARED_DATASETS)")
    return path


@pytest.fixture(scope="session")
def readme_api_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """The README's Python API example run as written (2 launched workers on Cora), in a
    fresh directory with its own dataset root; its namespace and that directory. Shared
    by the API and report tests, so the workers are started once."""
    import re

    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "README.md: no python block under '## Python API'"
    where = tmp_path_factory.mktemp("readme-api")
    patch = pytest.MonkeyPatch()
    patch.setenv("FULLGRAPH_DATA", str(where / "data"))
    patch.setenv("OMP_NUM_THREADS", "1")
    patch.chdir(where)
    try:
        namespace: dict = {"__name__": "readme_example"}
        exec(compile(code.group(1), "README.md (Python API)", "exec"), namespace)
    finally:
        patch.undo()
    return namespace, where
