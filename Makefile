# concept-encoder: set-up, tests and training entry points.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch 2.13.0 is the CPU build on these machines; any range the project declares admits it.
TORCH_VERSION ?= 2.13.0

# The main job's knobs: `make train PRESET=tiny STEPS=100 DATASET=path/to/texts ARGS="--masking span"`
PRESET    ?= small
STEPS     ?= 300
DATASET   ?= embedded
TOKENIZER ?= train:wordpiece:8000
SEQ_LEN   ?= 128
BATCH     ?= 16
ARGS      ?=
LAUNCH    := $(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no

.PHONY: install test lint format clean train

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

# Main job: MLM pretraining on the embedded offline corpus (CPU is fine: a few minutes).
train: install
	$(LAUNCH) loops/mlm.py --preset $(PRESET) --max_steps $(STEPS) --dataset $(DATASET) \
		--tokenizer $(TOKENIZER) --max_seq_length $(SEQ_LEN) --per_device_train_batch_size $(BATCH) $(ARGS)
