# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=
# The hf extra needs torch; pinning it first takes a CPU build (the bare name would pull
# several GB of CUDA packages). Override with TORCH=torch on a GPU box, or TORCH= to skip.
TORCH  ?= torch==2.13.0

.PHONY: train test venv clean

venv: $(STAMP)

# Re-install only when the dependency list changes.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev,hf,data]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

# MESHLM_REQUIRE_EXTRAS=1: the extras were installed above, so a test that needs a missing one
# fails instead of skipping (tests/conftest.py, `require`).
test: $(STAMP)
	MESHLM_REQUIRE_EXTRAS=1 $(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) runs .pytest_cache
