# concept-encoder: set-up, tests and training entry points.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch 2.13.0 is the CPU build on these machines; any range the project declares admits it.
TORCH_VERSION ?= 2.13.0

.PHONY: install test lint format clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install -e ".[dev]"
	touch $@

test: install
	$(VENV)/bin/ruff check concept_encoder loops tests
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check concept_encoder loops tests
	$(VENV)/bin/ruff format --check concept_encoder loops tests

format: install
	$(VENV)/bin/ruff check --fix concept_encoder loops tests
	$(VENV)/bin/ruff format concept_encoder loops tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
