# sparsetrain: `make help` lists the targets.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# x86_64 Python 3.11 boxes carry these wheels on disk; elsewhere pip picks a build for the machine.
TORCH_PINS ?= $(shell [ "$$(uname -m)" = x86_64 ] && echo "torch==2.14.1 torchvision==0.29.1")
RESULTS ?= results
FIGURES ?= figures
ANALYSE = $(PY) -m sparsetrain.analysis --quiet

.PHONY: help venv data run test test-full lint figures bench bench-step bench-ddp bench-model gpu-check slurm-up slurm-down clean

help:  ## show this help
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_PINS),$(PY) -m pip install -q $(TORCH_PINS))
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

venv: $(VENV)/.installed  ## create .venv with the package and dev tools (once)

data:  ## make Fashion-MNIST available offline (Debian package when apt and root are there)
	@bash scripts/get_data.sh

run: venv data  ## the main job: dense vs top-k vs random-k vs block-k at 1%, 2 ranks, Fashion-MNIST
	$(PY) -m sparsetrain.benchmarks.compare

test: venv data  ## fast test suite (under ~10 minutes on 2 cores)
	$(PY) -m pytest -m "not slow" -q

test-full: venv data  ## every test, slow ones too
	$(PY) -m pytest -q

lint: venv  ## ruff
	$(VENV)/bin/ruff check sparsetrain tests scripts

comma := ,
TTA_TARGET ?= 0.75
TTA_RESULTS = $(wildcard $(RESULTS)/baseline $(RESULTS)/rq1_scope)
# $(call study,NAME,FOLDERS): one study's tables and figures from those result folders that exist.
# $(3): extra arguments, e.g. --where filters.
study = $(if $(wildcard $(2)),$(ANALYSE) --study $(1) $(wildcard $(2)) --out $(FIGURES)/$(1) $(3),@echo "figures: $(1): no results yet")

figures: venv  ## every table and figure from $(RESULTS) alone: studies into $(FIGURES), benchmarks in place
	$(PY) -m sparsetrain.analysis --quiet $(RESULTS) --out $(FIGURES)/by_sweep
	@# Each research question from every sweep that holds its points (dense, other presets, ...).
	$(call study,stability,$(RESULTS)/stability $(RESULTS)/ablation)
	@# Time to $(TTA_TARGET) test accuracy: measured compute + predicted exchange (default alpha-beta),
	@# from the second pass's 2-rank runs (dense baseline, RQ1's schemes and scopes).
	$(if $(TTA_RESULTS),$(ANALYSE) $(TTA_RESULTS) --time-to-accuracy $(TTA_TARGET) --bandwidth 1$(comma)10$(comma)100 --workers 8$(comma)64 --out $(FIGURES)/time_to_accuracy,@echo "figures: time_to_accuracy: no results yet")
	$(call study,rq1_scope,$(RESULTS)/baseline $(RESULTS)/rq1_scope)
	$(call study,rq2_scheme,$(RESULTS)/baseline $(RESULTS)/rq1_scope $(RESULTS)/rq2_scheme $(RESULTS)/rq2_low,--where scope=layerwise)
	$(call study,rq3_aggregation,$(RESULTS)/rq1_scope $(RESULTS)/rq3_aggregation $(RESULTS)/rq4_workers,--where scheme=randk$(comma)blockk --where scope=layerwise)
	$(call study,rq4_workers,$(RESULTS)/baseline $(RESULTS)/rq1_scope $(RESULTS)/rq4_workers $(RESULTS)/rq4_global)
	$(call study,rq5_speed,$(RESULTS)/rq5_speed)
	$(call study,ddp_hooks,$(RESULTS)/baseline $(RESULTS)/ddp_hooks $(RESULTS)/ddp_hooks_trainer)
	$(PY) -m sparsetrain.benchmarks.step --report $(RESULTS)/bench/step.json --out $(RESULTS)/bench
	$(PY) -m sparsetrain.benchmarks.collectives --model-only --out $(RESULTS)/bench

bench: venv  ## compressor micro-benchmark (1 thread, 3 rounds) -> results/bench/compress.json
	$(PY) -m sparsetrain.benchmarks.compress --threads 1 --json results/bench/compress.json

bench-step: venv  ## 4 ranks on a netcluster: step time of every studied scheme vs bandwidth, 9 interleaved rounds, medians + 95% intervals (root; ~40 min on 2 cores)
	$(PY) -m sparsetrain.benchmarks.step --out results/bench

bench-ddp: venv  ## 4 ranks on a tc-shaped netns cluster: DDP + sparsetrain hooks vs PowerSGD, fp16, DDP, compute (root)
	$(PY) -m sparsetrain.benchmarks.ddp --out results/bench

bench-model: venv  ## collective micro-benchmark, alpha-beta fit, model check, break-even map (root, after bench-step)
	$(PY) -m sparsetrain.benchmarks.collectives --out results/bench

gpu-check: venv  ## the CUDA path on one GPU (<5 min): cuda tests, compressor + step-time benchmarks -> results/bench/gpu_*
	PY=$(PY) OUT=$(RESULTS)/bench bash scripts/gpu_check.sh

slurm-up:  ## start the single-node SLURM cluster on this machine (root)
	bash scripts/slurm_cluster.sh start

slurm-down:  ## stop it
	bash scripts/slurm_cluster.sh stop

clean:  ## remove run outputs (keeps .venv and results/)
	rm -rf outputs multirun .pytest_cache
