# ddp-tricks: `make run` trains (2-process DDP), `make test` runs the suite; both set themselves up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?= 2
ARGS ?=

.PHONY: install-all run test lint format bench clean

install-all: $(STAMP)

# Re-installs only when a requirements file changed; seconds otherwise.
$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
	touch $(STAMP)

run: install-all
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) run.py $(ARGS)

test: install-all
	$(PY) -m pytest

lint: install-all
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install-all
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install-all
	$(PY) bench/optim_step.py
	$(PY) bench/e2e.py

clean:
	rm -rf $(VENV) runs .pytest_cache
