# Two entry points (see README): `make train` runs the main job, `make test` the suite.
# Both create and reuse a local virtual environment in .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
STAMP  := $(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)

.PHONY: train test lint venv bench clean

venv: $(STAMP)

# torch is pinned here, not in the package: an unpinned install would pull the CUDA
# build (several GB); 2.13.0 has a CPU build available to this project's machines.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

train: $(STAMP)
	$(VENV)/bin/fullgraph train --dataset cora --normalize-features --model gcn --epochs 200 \
		--strategy data --workers 2

test: $(STAMP) lint
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/python -m ruff check fullgraph tests
	$(VENV)/bin/python -m mypy

bench: $(STAMP)
	$(VENV)/bin/python -m fullgraph.bench.kernels

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
