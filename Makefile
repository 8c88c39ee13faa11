# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch/torchvision pinned to the builds this machine serves; pyproject declares ranges.
	$(PY) -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
	# The integrations extra: Lightning, Accelerate and Transformers, for their tests.
	$(PY) -m pip install -q -e ".[test,integrations]" "torch==2.14.1" "torchvision==0.29.1"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m mini_ddp demo

test: $(STAMP)
	$(PY) -m ruff check src tests examples
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --timeout=600 tests

lint: $(STAMP)
	$(PY) -m ruff check src tests examples

clean:
	rm -rf $(VENV) build *.egg-info runs
