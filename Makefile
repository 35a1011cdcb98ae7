# ddp-tricks: `make run` trains (DDP, one process per GPU, or 2 on CPU), `make test` runs the suite (`make test-fast`
# without the slow multi-process tests); all set themselves up first. `make gpu-check` checks a GPU machine with the
# Python it already has, installing nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?=
ARGS ?=
# pytest-xdist workers: the suite is mostly one busy core at a time (process start-up, one rank waiting on another),
# so two workers keep both cores of a 2-core machine busy and halve its wall time
TEST_WORKERS ?= 2

.PHONY: install-all run test test-fast test-extras lint format bench gpu-check clean

install-all: $(STAMP)

# Re-installs only when a requirements file or pyproject.toml changed; seconds otherwise. The project itself is
# installed in development mode (pip install -e .), so bench/, tools/ and examples/ import it like any library.
# pip compiles the ~10,000 installed .py files to bytecode one at a time (about 55 s here); compileall does it on
# every core instead, leaving out the packages' own test suites (28 s less on 2 cores, from a fresh clone). A file
# that does not compile is left to run from its source, as pip leaves it.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -r requirements.txt -r requirements-dev.txt
	$(PY) -m compileall -qq -j 0 -x '/tests?/|/torch/testing/_internal/' \
		"$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
		|| echo "compileall: a file did not compile (pip would skip it too); it runs from its source"
	$(PY) -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $(STAMP)

# NPROC unset: one process per visible GPU, or 2 without a GPU (torch answers from the driver; no CUDA context).
run: install-all
	@nproc="$(NPROC)"; why="NPROC=$(NPROC)"; \
	if [ -z "$$nproc" ]; then \
		gpus=$$($(PY) -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null | tail -n 1); \
		case "$$gpus" in ''|*[!0-9]*) gpus=0;; esac; \
		if [ "$$gpus" -gt 0 ]; then nproc=$$gpus; why="$$gpus GPU(s) visible"; else nproc=2; why="no GPU visible"; fi; \
		why="$$why; set NPROC=N to change"; \
	fi; \
	[ "$$nproc" = 1 ] && noun=process || noun=processes; \
	echo "make run: $$nproc $$noun ($$why)"; \
	echo "$(VENV)/bin/torchrun --standalone --nproc_per_node=$$nproc run.py $(ARGS)"; \
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$$nproc run.py $(ARGS)

test: install-all
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup

# The edit-test loop: everything but the slow multi-process tests (marked `slow`).
test-fast: install-all
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow"

# The optional integration that `make test` skips: NVIDIA DALI (--data-backend dali), about 500 MB of Linux-only wheels
# (1.1 GB installed) that stay out of requirements-dev.txt; installed into the venv here, its tests then run on the CPU
# (docs/development.md). CI runs it as a job of its own.
DALI := nvidia-dali-cuda120==2.4.0
test-extras: install-all
	$(PY) -m pip install --quiet --disable-pip-version-check $(DALI)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup tests/test_dali.py tests/test_data_backends.py

lint: install-all
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install-all
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install-all
	$(PY) bench/optim_step.py
	$(PY) bench/e2e.py
	$(PY) bench/step_log.py
	$(PY) bench/fsdp_memory.py
	$(PY) bench/activation_memory.py
	$(PY) bench/cached_accumulation.py
	$(PY) bench/noise_scale.py
	$(PY) bench/sparse_reduction.py
	$(PY) bench/input_pipeline.py
	$(PY) bench/reduction_memory.py
	$(PY) bench/muon.py

# No install-all: it runs on the machine's own Python (PYTHON=...), which needs torch and torchvision.
gpu-check:
	@$(PYTHON) tools/gpu_check.py

clean:
	rm -rf $(VENV) runs .pytest_cache
