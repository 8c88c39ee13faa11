# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint setup clean test-floor test-loaded test-some

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

# Three workers on two cores: some tests spend most of their time waiting (for a timeout, a
# stopped rank, a subprocess) while the others use the CPU; a fourth only adds contention (the
# suite keeps both cores busy with three). Each module runs on one worker (its module-scoped
# runs happen once), the longest first (tests/conftest.py).
PYTEST_PARALLEL ?= -n 3 --dist loadscope --no-loadscope-reorder
test: $(STAMP)
	$(PY) -m ruff check src tests examples scripts
	# The floor first, so the whole suite's summary is the last line of the run.
	$(MAKE) test-floor
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_PARALLEL) --timeout=600 --durations=15 tests

# `make test` on a busy machine: BUSY_PER_CORE busy loops per core run beside the suite (two per
# core: the CPU oversubscribed two times over before the suite's own processes), and are
# stopped however the run ends. TEST_TARGET=test-some TESTS="tests/x.py" narrows it down.
BUSY_PER_CORE ?= 2
TEST_TARGET   ?= test
test-loaded: $(STAMP)
	@n=$$(( $(BUSY_PER_CORE) * $$(nproc) )); pids=""; \
	for i in $$(seq $$n); do sh -c 'while :; do :; done' & pids="$$pids $$!"; done; \
	trap 'kill $$pids 2>/dev/null' EXIT INT TERM HUP; \
	echo "test-loaded: $$n busy loops on $$(nproc) cores"; \
	$(MAKE) $(TEST_TARGET)

# A part of the suite, the same way: `make test-some TESTS="tests/test_spawn.py"`.
TESTS ?= tests
test-some: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_PARALLEL) --timeout=600 --durations=15 $(TESTS)

lint: $(STAMP)
	$(PY) -m ruff check src tests examples scripts

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info runs

# The oldest torch we test (pyproject's floor): torch 2.11.0 on Python 3.12, in its own venv,
# running the parity subset against torch DDP 2.11 with this checkout's src/ (no install).
FLOOR_PYTHON ?= $(shell (python3.12 -c '' 2>/dev/null && echo python3.12) || ls -d "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1)
FLOOR_VENV   ?= .venv-floor
FLOOR_TESTS  := tests/test_core_parity.py tests/test_core_errors.py tests/test_comm_hooks.py \
                tests/test_join.py tests/test_dropin_reducer_mixed_precision.py \
                tests/test_dropin_errors.py tests/test_nccl_semantics.py tests/test_gpu_check.py \
                tests/test_device_timer.py tests/test_user_hooks.py tests/test_subgroups.py

$(FLOOR_VENV)/.installed:
	@test -n "$(FLOOR_PYTHON)" || { echo "test-floor: no Python 3.12 found (set FLOOR_PYTHON=...)"; exit 1; }
	test -x $(FLOOR_VENV)/bin/python || $(FLOOR_PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q "torch==2.11.0" "torchvision==0.26.0" numpy tqdm matplotlib scikit-learn pytest pytest-xdist pytest-timeout hypothesis
	touch $@

test-floor: $(FLOOR_VENV)/.installed
	PYTHONPATH=$(CURDIR)/src OMP_NUM_THREADS=1 $(FLOOR_VENV)/bin/python -m pytest -q $(PYTEST_PARALLEL) --timeout=600 $(FLOOR_TESTS)
