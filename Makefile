# Two entry points for a fresh machine; each builds its own virtualenv from the pinned lock.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-numerics test-bench validators

$(STAMP): requirements/cpu.txt requirements/base.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dfpipe demo

validators:
	bash deploy/install-validators.sh

test: $(STAMP) validators
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 -m "not bench_smoke" tests

# The numerics tests again on torch's plain CPU kernels: a verdict that follows the kernels' summation
# order (avx2 / avx512 / none) shows up in CI instead of on a user's machine.
test-numerics: $(STAMP)
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q -n 2 --dist loadfile -m numerics tests

# The GPU benchmark suite's CPU smoke (~2.5 min): CI runs it after `make test`.
test-bench: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist load --durations=5 -m bench_smoke tests/test_gpu_bench_smoke.py
