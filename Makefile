# Gyre on one machine. `make run` trains the embedded default; `make test` runs the whole suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: venv run test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch==2.13.0 is pinned in pyproject: the CPU wheel these machines carry, not a CUDA build.
	$(BIN)/pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

run: venv
	$(BIN)/gyre $(ARGS)

test: venv
	$(BIN)/python -m pytest tests -q $(PYTEST_ARGS)

bench: venv
	$(BIN)/python -m bench.learnability --vocab-bench
	$(BIN)/python -m bench.learnability
	$(BIN)/python -m bench.trajectory_cap
	$(BIN)/python -m bench.tree_packing
	$(BIN)/python -m bench.processor

clean:
	rm -rf runs outputs .pytest_cache
