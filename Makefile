# Two entry points (see README): `make train` runs the main job, `make test` the suite.
# Both create and reuse a local virtual environment in .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
STAMP  := $(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)

# The README's main command; `make install-check` runs it from an installed wheel.
MAIN := train --dataset cora --normalize-features --model gcn --epochs 200 --strategy data \
	--workers 2

.PHONY: train test lint venv bench clean install-check

venv: $(STAMP)

# torch 2.13.0 (the tested version; the package declares >=2.13,<2.14) is installed first,
# its CPU build: PyPI's Linux wheel is the CUDA build (several GB). The CPU build is taken
# from a wheel pip already finds (a local wheel directory), else from PyTorch's CPU index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet torch==2.13.0+cpu 2>/dev/null || \
	    $(VENV)/bin/pip install --quiet torch==2.13.0 --index-url $(TORCH_CPU_INDEX)
	$(VENV)/bin/pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

train: $(STAMP)
	$(VENV)/bin/fullgraph $(MAIN)

test: $(STAMP) lint
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/python -m ruff check fullgraph tests
	$(VENV)/bin/python -m mypy

# Build the wheel, install it into a fresh venv (CPU torch first) and run $(MAIN) with it.
install-check: $(STAMP)
	TORCH_CPU_INDEX=$(TORCH_CPU_INDEX) .ci/install-check $(PYTHON) $(VENV)/bin/pip -- $(MAIN)

bench: $(STAMP)
	$(VENV)/bin/python -m fullgraph.bench.kernels

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
