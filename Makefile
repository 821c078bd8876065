# Two entry points that work on a fresh machine: `make chain` and `make test`.
# Each creates .venv (Python >= 3.12) when missing and installs the project into it, with the
# extras in EXTRAS (default: dev, and cuda where nvidia-smi exists); another list, e.g.
# `make chain EXTRAS=dev,torch`, installs those on the next run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
EXTRAS := dev$(shell command -v nvidia-smi >/dev/null 2>&1 && echo ,cuda)
comma := ,
INSTALLED := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: chain test lint roofline clean-venv

$(INSTALLED): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), f"Python >= 3.12 needed, $(PYTHON) is {sys.version.split()[0]}"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

chain: $(INSTALLED)
	$(PY) -m experiments.chain --size=72MiB

roofline: $(INSTALLED)
	$(PY) -m experiments.roofline --device=h200

# two pytest processes, each test file whole in one of them (module fixtures start work ahead);
# no JAX process takes most of a GPU's memory up front
test: $(INSTALLED)
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest -q -n 2 --dist loadfile

lint: $(INSTALLED)
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

clean-venv:
	rm -rf $(VENV)
