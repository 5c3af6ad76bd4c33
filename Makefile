# One entry point for the common jobs. `make demo` and `make test` each do their own set-up on a fresh machine.
PY ?= python3
PYTEST_ARGS ?=
# Test workers (pytest-xdist, whole files per worker): 2 took the suite from 25.5 to 16.1 min on a 2-core machine
# (stop 47); 0 runs it in one process.
PYTEST_WORKERS ?= 2
# CPU threads per test worker (OpenMP: torch's ops; OpenBLAS: NumPy's, which the Triton interpreter's dots use), unless
# the environment sets them: two workers of two threads each on a 2-core machine contend (four test files: 207 s, one
# thread each: 158 s; stop 51).
TEST_THREADS ?= 1
# The test log ends with the 25 slowest tests (--durations): where CI's time goes (stop 73: the dense step's
# interpreter tests were half of it).

.PHONY: setup demo test lint bench gpu-check

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) examples/demo.py

test:
	bash scripts/setup.sh test
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$(TEST_THREADS)} OPENBLAS_NUM_THREADS=$${OPENBLAS_NUM_THREADS:-$(TEST_THREADS)} \
	MKL_NUM_THREADS=$${MKL_NUM_THREADS:-$(TEST_THREADS)} \
	$(PY) -m pytest -q -p no:cacheprovider --timeout=900 --durations=25 -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint:
	$(PY) -m ruff check src kernels tests benchmarks examples scripts
	$(PY) -m ruff format --check src kernels tests benchmarks examples scripts

bench:
	$(PY) benchmarks/run_all.py

# Run on the GPU machine (device tool): CUDA-parametrised tests + gpu-marked tests + a short kernel benchmark.
gpu-check:
	bash scripts/gpu_check.sh
