# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The GPU and TPU compilers (jax-cuda12 plugin + pjrt, libtpu) for plan.py, installed
# beside the venv's packages, not among them: only the planner's compiling process loads them.
COMPILERS := $(VENV)/compilers
COMPILERS_STAMP := $(COMPILERS)/.installed-stamp
ARGS   ?=
# The hf extra needs torch; pinning it first takes a CPU build (the bare name would pull
# several GB of CUDA packages). Override with TORCH=torch on a GPU box, or TORCH= to skip.
TORCH  ?= torch==2.13.0

.PHONY: train test test-slurm venv compilers clean

venv: $(STAMP)

# Each install step is one line saying what it installs (scripts/quietly.sh): pip's own output,
# setuptools' warnings among it, is shown only if the step fails.
STEP := scripts/quietly.sh

# Re-install only when the dependency list changes.
$(STAMP): pyproject.toml
	@$(STEP) "creating the virtual environment $(VENV)" $(PYTHON) -m venv $(VENV)
	@$(STEP) "upgrading pip" $(BIN)/python -m pip install -q --upgrade pip
	@$(if $(TORCH),$(STEP) "installing $(TORCH)$(if $(filter torch==%,$(TORCH)), (CPU build))" \
	  $(BIN)/python -m pip install -q $(TORCH),true)
	@$(STEP) "installing meshlm and its extras (dev hf data trackers eval storage)" \
	  $(BIN)/python -m pip install -q -e '.[dev,hf,data,trackers,eval,storage]'
	@touch $(STAMP)

# Pinned to the installed jax by `python -m planner.targets --requirements`.
$(COMPILERS_STAMP): $(STAMP)
	@$(STEP) "installing the GPU/TPU compilers for plan.py (about 1.1 GB)" $(BIN)/python -m pip install -q \
	  --no-deps --target $(COMPILERS) $$($(BIN)/python -m planner.targets --requirements)
	@touch $(COMPILERS_STAMP)

compilers: $(COMPILERS_STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

# MESHLM_REQUIRE_EXTRAS=1: the extras and compilers were installed above, so a test that needs
# a missing one fails instead of skipping (tests/conftest.py, `require`). `--dist loadfile`: each
# pytest worker runs whole files (most tests are single-threaded Python or one XLA compile; a
# file's module fixtures are compiled once), in the order tests/conftest.py sorts them (longest
# first: `--no-loadscope-reorder` keeps xdist from sorting by number of tests). The fake-CPU-device run has one worker per core and
# one more (TEST_WORKERS): a test that waits on processes it started (their start-up, a signal, a
# lock's heartbeat, a killed peer's timeout) leaves its worker's core idle, and the extra worker
# runs a file there meanwhile. The
# real-target compiles keep one worker per core (-n auto): they never wait. Two runs, timed apart:
# the fake-CPU-device tests, then the compiles for real H100 and TPU targets (tests marked
# real_target); each prints its 15 slowest tests. The real-target compiles are handed out a test
# at a time (`--dist loadgroup`: tests/test_targets.py holds most of them, and by file they ran on
# one worker while the other sat idle), except tests marked with one xdist_group, which share a
# module fixture's compiles and go to one worker together.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
test: $(STAMP) $(COMPILERS_STAMP)
	MESHLM_REQUIRE_EXTRAS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 -m "not real_target" tests
	MESHLM_REQUIRE_EXTRAS=1 $(BIN)/python -m pytest -q -n auto --dist loadgroup --no-loadscope-reorder --durations=15 -m real_target tests

# A real one-node SLURM runs a sweep's array job and a 2-process srun (scripts/slurm_check.sh).
# Debian's packages are installed only where a command is missing (CI starts from a clean
# machine), quietly: apt's output goes to a log shown only if the install fails.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

test-slurm: $(STAMP)
	@for cmd in munged slurmctld slurmd sbatch srun; do command -v $$cmd >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing $(SLURM_PACKAGES) with apt-get"; \
	  log=$$(mktemp); \
	  { $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $(SLURM_PACKAGES); } >$$log 2>&1 || { cat $$log; rm -f $$log; exit 1; }; \
	  rm -f $$log; \
	fi
	PYTHON=$(BIN)/python scripts/slurm_check.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
