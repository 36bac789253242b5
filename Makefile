# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=

.PHONY: train test venv clean

venv: $(STAMP)

# Re-install only when the dependency list changes.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) runs .pytest_cache
