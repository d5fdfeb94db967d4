# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv if missing and
# install once (a second call installs nothing: the stamp file is newer than setup.cfg).
PYTHON ?= python3
VENV ?= .venv
# Kept if torch is already importable in the venv; override for a CUDA machine, e.g.
#   make demo TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.zerotrain-installed

.PHONY: install bytecode demo test test-fast test-gpu bench bench-gpu bench-gpu-peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# pip byte-compiles what it installs one file at a time, on one core (~55 of a fresh install's ~100 CPU-s here).
# Installed with --no-compile instead, and compiled by compileall on every core: torch's files while pip installs
# the rest, then the rest (files already compiled are skipped). A fresh venv: 101 -> 78.5 s on 2 cores. The exit
# status of compileall is not checked: a few installed files are not Python 3.11 (pip skips them too).
SITE = $$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# `make test` on a fresh venv: DeepSpeed (its line of setup.cfg) installed first, then the DeepSpeed ops the suite
# loads JIT-built in the background (tests/helpers/build_ops.py, ~450 CPU-s on a fresh host) while pip installs the
# rest: pip leaves one of 2 cores idle for about a minute. The process has a session of its own (a Ctrl-C of make
# never kills it mid-build, which would leave torch's build lock), and the suite's environment (CXX and
# CUDA_VISIBLE_DEVICES as tests/conftest.py sets them: ninja rebuilds an op whose compiler command changed); the
# suite's own loads find the ops built or wait on torch's lock for them.
DEEPSPEED_REQ = $$($(BIN)/python -c "import configparser; c = configparser.ConfigParser(); c.read('setup.cfg'); \
	print(next(r for r in c['options']['install_requires'].split() if r.startswith('deepspeed')))")
OPS_LOG = $${TMPDIR:-/tmp}/zerotrain-install-ops-$$(id -u).log
BUILD_OPS_EARLY = $(BIN)/pip install -q --no-compile "$(DEEPSPEED_REQ)" && \
	CUDA_VISIBLE_DEVICES= CXX="$${CXX:-$(CURDIR)/tests/helpers/g++-no-debug-info}" \
	setsid -f $(BIN)/python tests/helpers/build_ops.py > "$(OPS_LOG)" 2>&1 < /dev/null && \
	echo "make: building DeepSpeed's CPU ops in the background while pip installs the rest (log: $(OPS_LOG))"
$(STAMP): setup.cfg pyproject.toml | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q --no-compile $(TORCH_SPEC)
	@$(BIN)/python -m compileall -q -j 0 $(SITE)/torch > /dev/null 2>&1 & \
	$(if $(filter test,$(MAKECMDGOALS)),$(BUILD_OPS_EARLY);) \
	$(BIN)/pip install -q --no-compile -e ".[test]"; status=$$?; wait; exit $$status
	@$(BIN)/python -m compileall -q -j 0 $(SITE) > /dev/null 2>&1 || true
	@touch $@

install: $(STAMP)

# The editable install's own sources byte-compiled, as pip compiles every package it installs: with
# PYTHONDONTWRITEBYTECODE set (some hosts set it), each process would compile ~120 of our modules from source
# again (~0.2 CPU-s a process; a suite starts ~500 of them). Up-to-date files are skipped; a file edited later is
# compiled again here, and Python itself never uses a stale one.
bytecode: install
	@$(BIN)/python -m compileall -q -j 0 zerotrain launcher modeling dataio ds_configs recipes > /dev/null

demo: install
	$(BIN)/zerotrain demo

# Three pytest-xdist workers on 2 cores: a launch's start-up and its ranks' waits (a kill's deadline, a slowed step,
# a rendezvous) leave about a fifth of 2 cores idle with two (a run with its ops built: 31 CPU-min in 19.5 min). Fresh
# clones on one host (2026-11-27/28, make wall, CPU-min): three 27.6 / 47.5 against two 28.5 / 46.3; after the op
# build was no longer waited on first, three 24.2, 25.0, 25.7 min (42-45 CPU-min) against two's last 25.9 (before
# that change): a small gain at best, within run-to-run noise. --dist loadfile keeps each
# file (and its module-scoped runs, shared by its tests) on one worker; tests/conftest.py keeps the workers' launches
# apart (rendezvous port, op builds) and orders the files longest first (--no-loadscope-reorder keeps that order:
# xdist would sort them by test count). TEST_WORKERS=0: serial.
TEST_WORKERS ?= 3
test: install bytecode
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# For edit loops: every test that starts no process (no ranks, no python subprocess, no kernel); the tests
# marked `launches` are left out (tests/conftest.py fails a test that launches without the marker). On the same
# workers as `make test` (TEST_WORKERS=0: serial).
test-fast: install bytecode
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not launches"

# On a CUDA host: what torch and DeepSpeed do on the GPU (tests/test_gpu_cuda.py); each test says why it is
# skipped where no GPU (or a second one) is visible.
test-gpu: install
	$(BIN)/python -m pytest -m gpu tests/test_gpu_cuda.py

bench: install
	$(BIN)/python benchmarks/run.py

# One CUDA GPU: each shipped GPU recipe's shape (model, seq len, vocabulary, micro-batch, its profile's stage,
# checkpointing and optimizer), one table for benchmarks/RESULTS.md (benchmarks/gpu.py; --model for the older grid). Without CUDA: one line, exit 0, nothing run.
bench-gpu: install
	$(BIN)/python benchmarks/gpu.py

# One CUDA GPU: our driver (as shipped on 2026-11-26, and now) beside a plain torch loop on our model and Hugging
# Face Llama (and liger-kernel), interleaved, one table (benchmarks/gpu_peers.py; docs/benchmarks.md). On a lent
# machine without our install: benchmarks/gpu_peers_device.sh. Without CUDA: one line, exit 0, nothing run.
bench-gpu-peers: install
	$(BIN)/python benchmarks/gpu_peers.py

clean:
	rm -rf runs .pytest_cache
