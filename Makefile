# Two entry points on a fresh machine: `make demo` and `make test`. Each builds its own virtualenv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Pinned so pip takes the local CPU wheel instead of a multi-GB CUDA build; on a GPU machine install torch first.
TORCH ?= torch==2.13.0
DEPS := "diffusers==0.42.1" "transformers==5.23.*" "accelerate==1.15.*" "triton==3.9.*" tokenizers
# setuptools >= 70.1: tests/test_wheel.py builds the wheel without isolation (a 3.11 venv starts with 65.5)
TEST_DEPS := pytest matplotlib nbclient nbformat ipykernel torchmetrics "setuptools>=70.1"

.PHONY: demo test test-gpu test-matrix clean

$(VENV)/.ready: setup.cfg pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q $(DEPS) $(TEST_DEPS)
	$(PY) -m pip install -q --no-deps -e .
	touch $@

demo: $(VENV)/.ready
	$(PY) -m sparsepatch demo

# Triton kernels are tested on CPU through the interpreter; CUDA tests are skipped without a GPU.
test: $(VENV)/.ready
	TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=10

# The numeric tests under two ATen vector widths x 1 and 2 threads: the summation order of torch's CPU kernels
# changes with both (ATEN_CPU_CAPABILITY is read when torch is imported; --threads is tests/conftest.py's option),
# and every tolerance (tests/kernel_checks.py's error model) must hold whatever the CPU. Not part of `make test`
# (about 4x its time). Prints the tightest bounds seen (err / bound over all runs) from $(MATRIX_LOG).
MATRIX_TESTS ?= tests/test_tolerances.py tests/test_reference.py tests/test_parallel.py tests/test_diffusers_adapter.py \
	tests/test_transformers_adapter.py tests/test_stateful.py tests/test_validate.py tests/test_dense_precision.py \
	tests/test_dense_splitd.py tests/test_skip_triton.py tests/test_skip_backward.py tests/test_lightning.py \
	tests/test_nsa.py tests/test_nsa_decode.py tests/test_nsa_backward.py tests/test_recipes.py
MATRIX_CAPS ?= default avx2
MATRIX_THREADS ?= 1 2
MATRIX_LOG ?= .pytest_cache/tolerances.jsonl
test-matrix: $(VENV)/.ready
	@mkdir -p $(dir $(MATRIX_LOG)); rm -f $(MATRIX_LOG); fail=""; \
	for cap in $(MATRIX_CAPS); do for n in $(MATRIX_THREADS); do \
		echo "== ATEN_CPU_CAPABILITY=$$cap, $$n threads"; \
		ATEN_CPU_CAPABILITY=$$cap TRITON_INTERPRET=1 SPARSEPATCH_TOL_LOG=$(abspath $(MATRIX_LOG)) \
			$(PY) -m pytest -q --threads $$n $(MATRIX_TESTS) || fail="$$fail $$cap/$$n"; \
	done; done; \
	$(PY) tests/kernel_checks.py $(MATRIX_LOG); \
	if [ -n "$$fail" ]; then echo "failed under:$$fail"; exit 1; fi

# On a CUDA machine (uses the ambient python). One process per file: a fault in one file's kernels cannot take the
# others down. (The cross-file fault of sessions 1-2, a lightning prefill after split-D kernels, reproduced by
# benchmarks/repro_prefill_fault.py, is avoided by the BV=64 prefill default since session 3.)
test-gpu:
	for f in tests/test_*.py; do python3 -m pytest -q -m gpu $$f; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
