# `make test` and `make demo` work on a fresh clone: they build .venv first.
PYTHON ?= python3
# The CPU build lying on this machine's disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test demo bench clean

$(VENV)/.installed: setup.cfg setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[test,demo,lightning]'
	touch $@

test: $(VENV)/.installed
	$(BIN)/python -m pytest tests

demo: $(VENV)/.installed
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/bench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
