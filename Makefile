# keras-lms: `make test` and `make demo` set everything up on a fresh machine and are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.keras-lms-installed
HVD_STAMP := $(VENV)/.horovod-installed

.PHONY: install test test-lane-tensorflow test-lane-jax-torch test-tensorflow test-torch test-jax test-fast test-horovod test-jax-compile jax-compile-env lint docs bench demo horovod clean-venv

install: $(STAMP) $(HVD_STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Re-run only when the package metadata changes.
# torch==2.13.0 resolves to the CPU wheel on local disk (never a CUDA build in CI).
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e ".[tensorflow-cpu,jax,dev,plot,examples]"
	$(PIP) install -q torch==2.13.0
	touch $@

# Horovod is built from source once per machine (wheel cached under ~/.cache/keras-lms/wheels, shared by all clones); see docs/horovod.md.
$(HVD_STAMP): scripts/install_horovod.sh $(STAMP)
	bash scripts/install_horovod.sh $(PY)
	touch $@

horovod: $(HVD_STAMP)

# One suite, run once per Keras backend: unmarked tests run under all three, tests marked `tensorflow` (Horovod,
# graph inspection), `torch` (tests/offload/torch/) or `jax` (tests/offload/jax/) only under theirs and are skipped,
# with the reason, under the others. The JAX run is on the CPU (JAX_PLATFORMS=cpu: no CUDA plugin is looked for);
# its tests of the compiled GPU program skip here and run in `make test-jax-compile`.
# Two lanes side by side (`-j2`; each lane's output is printed whole when it ends: `-O`; no shared .pytest_cache):
# TensorFlow (its Horovod jobs included) in one; JAX, then torch, then TensorFlow's `TF_SECOND_LANE` modules in
# the other, which balances the lanes. Measured on the 2-core machine (2026-12-04, docs/benchmarks.md "The test
# suite's wall time"): TensorFlow alone 1763 s and JAX alone 1072 s; side by side both were done in 2018 s; three
# runs at once were slower than one after the other (every run's thread pools fight for the same two cores).
# (session 15: the slab-choice and keep modules, ~65 s, moved here as the JAX oracle stopped running eager forwards;
# session 16: the link-traffic module, ~215 s in CI, as the JAX run compiles at LLVM level 0, 1810 -> 1240 s; the
# slab-choice module back to the first lane: a CI rehearsal had the lanes at 2016 s and 1240 + 292 + 565 s)
# (session 26: the keep module, ~35 s, back to the first lane: the second was ~240 s longer in session 25's
# rehearsals, 1820 s against 1584)
TF_SECOND_LANE := tests/offload/tensorflow/test_zoo_slabs.py tests/offload/tensorflow/test_sweeps.py \
	tests/offload/tensorflow/test_link_traffic.py
PYTEST := $(PY) -m pytest -q -ra -p no:cacheprovider --durations=40 --durations-min=5
TF_RUN := KERAS_BACKEND=tensorflow $(PYTEST)

test: install
	$(MAKE) --no-print-directory -j2 -O test-lane-tensorflow test-lane-jax-torch

test-lane-tensorflow: install
	$(TF_RUN) $(addprefix --ignore=,$(TF_SECOND_LANE)) tests

test-lane-jax-torch: install
	$(MAKE) --no-print-directory test-jax
	$(MAKE) --no-print-directory test-torch
	$(TF_RUN) $(TF_SECOND_LANE)

test-tensorflow: install
	$(TF_RUN) tests

test-torch: install
	KERAS_BACKEND=torch $(PYTEST) tests

# XLA's CPU back end compiles at LLVM optimisation level 0 in the JAX run: the suite compiles far more than it
# runs (DenseNet121's float64 oracle: 140 -> 87 s alone). What the tests check is decided before LLVM: the HLO
# that XLA optimises, fuses, schedules and assigns buffers in is the same (DenseNet121's wrapped and plain
# gradients came out identical at level 0, 9e-6 apart at the default level, within the tolerance either way).
JAX_TEST_XLA_FLAGS := --xla_backend_optimization_level=0
test-jax: install
	KERAS_BACKEND=jax JAX_PLATFORMS=cpu XLA_FLAGS="$(JAX_TEST_XLA_FLAGS) $$XLA_FLAGS" $(PYTEST) tests

# Unit tests only (no model zoo, no multi-process Horovod runs).
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow and not horovod" tests

test-horovod: install
	$(TF_RUN) -m horovod tests

# The JAX offload, checked in the program XLA compiles for an H100 (no GPU needed, but the jax CUDA plugin: ~5.5 GB,
# so its own environment, .venv-jax, made on first use; docs/jax_findings.md).
JAX_VENV := .venv-jax
JAX_STAMP := $(JAX_VENV)/.keras-lms-installed
$(JAX_STAMP): pyproject.toml
	$(PYTHON) -m venv $(JAX_VENV)
	$(JAX_VENV)/bin/pip install -q --upgrade pip
	$(JAX_VENV)/bin/pip install -q -e ".[dev,jax-gpu-compile]"
	touch $@

jax-compile-env: $(JAX_STAMP)

# Only the tests marked jax_gpu_compile: the rest of tests/offload/jax runs in `make test`'s JAX pass.
test-jax-compile: $(JAX_STAMP)
	KERAS_BACKEND=jax JAX_PLATFORMS=cpu KERAS_LMS_REQUIRE_GPU_COMPILE=1 $(JAX_VENV)/bin/python -m pytest -q -ra \
		-p no:cacheprovider --durations=10 --durations-min=5 -m jax_gpu_compile tests/offload/jax

# ruff, configured in pyproject.toml ([tool.ruff]).
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The API reference (HTML, from the docstrings) in docs/api/; fails on an import error, a pdoc warning or a
# public docstring without its Args/Returns/Raises/Example sections. keras_lms.horovod needs Horovod installed.
docs: install
	$(PY) scripts/api_docs.py docs/api

# Side-by-side benchmarks; results are recorded in docs/benchmarks.md and docs/horovod.md.
bench: install
	$(PY) -m benchmarks.cpu_overhead
	$(PY) -m benchmarks.report_accuracy
	$(PY) -m benchmarks.horovod_scaling

demo: install
	bash scripts/demo.sh $(PY)

clean-venv:
	rm -rf $(VENV)
