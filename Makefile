# Gyre on one machine. `make run` trains the embedded default; `make test` runs the whole suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
# pytest-xdist workers for the test targets. Most of the suite waits on processes it starts
# (engines, harnesses, sandboxes, Slurm), so three workers on a 2-core machine beat two; 0 runs
# it serially in one process.
TEST_WORKERS ?= 3

# The real Claude Code binary for the harness tests: npm package, version pinned (notes §1: a
# bare install resolves to an old 2.1.x). tests/harness_proxy/claude_code.py reads this line.
CLAUDE_CODE_VERSION := 2.1.332
CLAUDE_CODE_STAMP   := .tools/claude-code/.installed-$(CLAUDE_CODE_VERSION)

# mini-swe-agent (OpenAI API harness, via litellm) in its own venv: it pins its own openai/pydantic.
MINI_SWE_AGENT_VERSION := 2.4.6
MINI_STAMP := .tools/mini-swe-agent/.installed-$(MINI_SWE_AGENT_VERSION)

# Qwen Code (npm, OpenAI API), the harness made for Qwen models. 0.15.10 runs on Debian 12's node 20;
# newer releases want node >= 22.
QWEN_CODE_VERSION := 0.15.10
QWEN_CODE_STAMP   := .tools/qwen-code/.installed-$(QWEN_CODE_VERSION)

# LiteLLM's proxy, bench.proxy's peer, in its own venv (it pins its own openai/pydantic). 1.107.0 was
# a compromised release; 1.106.12 is the newest whose [proxy] extra resolves from the registry here.
LITELLM_VERSION := 1.106.12
LITELLM_STAMP   := .venv-litellm/.installed-$(LITELLM_VERSION)

# Debian packages the tests need, so `make test` sets up a fresh machine by itself: bubblewrap
# (sandbox=bwrap) and the system Python's pytest (hidden tests run inside the sandbox, which shows
# the read-only system, not the project's venv); a real local Slurm for tests/slurm (slurmdbd and
# MariaDB because submitit learns a job's fate through sacct); libibverbs for Mooncake's CPU build;
# npm for the pinned Claude Code and Qwen Code; chromium (headless) for the trajectory viewer's page tests.
TEST_DEBS := bubblewrap python3-pytest slurm-wlm munge slurmdbd mariadb-server libibverbs1 ibverbs-providers chromium
NPM_DEBS  := $(if $(shell command -v npm),,nodejs npm)

.PHONY: venv system-packages claude-code mini-swe-agent qwen-code litellm run test test-fast bench gpu-env gpu-check clean

venv: $(STAMP)

system-packages:
	@missing=$$(for p in $(TEST_DEBS) $(NPM_DEBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "missing Debian packages: run: sudo apt-get install -y $$missing"; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

claude-code: $(CLAUDE_CODE_STAMP)

$(CLAUDE_CODE_STAMP):
	mkdir -p .tools/claude-code
	rm -f .tools/claude-code/.installed-*
	npm install --prefix .tools/claude-code --no-audit --no-fund --no-save @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION)
	.tools/claude-code/node_modules/.bin/claude --version
	touch $@

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch==2.13.0 is pinned in pyproject: the CPU wheel these machines carry, not a CUDA build.
	$(BIN)/pip install --quiet -e '.[test,cpu]'
	# The pinned sglang wheel WITHOUT its dependencies (torch 2.14.1, CUDA 13, transformers 5.19 would
	# replace this venv's): the tests read SGLang's HTTP contract from its files and never import it
	# (tests/support/sglang_contract.py). An extra cannot say --no-deps, so it is installed here.
	$(BIN)/pip install --quiet --no-deps sglang==0.5.23
	rm -f $(VENV)/.installed-*
	touch $@

qwen-code: $(QWEN_CODE_STAMP)

$(QWEN_CODE_STAMP):
	mkdir -p .tools/qwen-code
	rm -f .tools/qwen-code/.installed-*
	npm install --prefix .tools/qwen-code --no-audit --no-fund --no-save @qwen-code/qwen-code@$(QWEN_CODE_VERSION)
	.tools/qwen-code/node_modules/.bin/qwen --version
	touch $@

mini-swe-agent: $(MINI_STAMP)

$(MINI_STAMP):
	test -x .tools/mini-swe-agent/bin/python || $(PYTHON) -m venv .tools/mini-swe-agent
	rm -f .tools/mini-swe-agent/.installed-*
	.tools/mini-swe-agent/bin/pip install --quiet mini-swe-agent==$(MINI_SWE_AGENT_VERSION)
	touch $@

litellm: $(LITELLM_STAMP)

$(LITELLM_STAMP):
	test -x .venv-litellm/bin/python || $(PYTHON) -m venv .venv-litellm
	rm -f .venv-litellm/.installed-*
	.venv-litellm/bin/pip install --quiet 'litellm[proxy]==$(LITELLM_VERSION)'
	touch $@

# The pinned Claude Code comes with the install, so `.venv/bin/gyre +experiment=claude_code` runs
# right after `make run` (bubblewrap, for sandbox=bwrap, is `make system-packages`).
run: venv claude-code
	$(BIN)/gyre $(ARGS)

test: system-packages venv claude-code mini-swe-agent qwen-code
	$(BIN)/python -m pytest tests -q -n $(TEST_WORKERS) --durations=25 $(PYTEST_ARGS)

# The edit loop: no end-to-end runs, no Slurm, no system packages or harness binaries, no
# multi-process cells (tests/conftest.py lists what is left out and why). Includes the docs' link check.
test-fast: venv
	$(BIN)/python -m pytest tests -q -m "not e2e and not slow" -n $(TEST_WORKERS) --durations=10 $(PYTEST_ARGS)

bench: venv litellm claude-code
	$(BIN)/python -m bench.learnability --vocab-bench
	$(BIN)/python -m bench.learnability
	$(BIN)/python -m bench.trajectory_cap
	$(BIN)/python -m bench.tree_packing
	$(BIN)/python -m bench.processor
	$(BIN)/python -m bench.proxy
	$(BIN)/python -m bench.proxy_load
	$(BIN)/python -m bench.wire_fuzz --cases 10000
	$(BIN)/python -m bench.soak
	$(BIN)/python -m bench.transfer
	$(BIN)/python -m bench.switch
	$(BIN)/python -m bench.kv_reuse
	$(BIN)/python -m bench.elastic --runs-dir runs/bench-elastic
	$(BIN)/python -m bench.elastic --workload drift --fit runs/bench-elastic/result.json --runs-dir runs/bench-elastic-drift
	$(BIN)/python -m bench.simulate --drift --fit runs/bench-elastic/result.json --calibrate runs/bench-elastic-drift/result.json
	$(BIN)/python -m bench.elastic --workload moving --fit runs/bench-elastic/result.json --runs-dir runs/bench-elastic-moving
	$(BIN)/python -m bench.elastic --workload moving --lose-cell 3@10 --fit runs/bench-elastic/result.json --runs-dir runs/bench-elastic-moving-loss
	$(BIN)/python -m bench.simulate --moving --partial --stragglers 8
	$(BIN)/python -m bench.served_whatif bench/traces/p2_4t_moving.json --staleness 1 2

# The GPU stack (engine=sglang trainer=megatron transfer=mooncake) in .venv-gpu, on a GPU node: the venv the
# GPU recipes (slurm/gyre_122b.sbatch, gyre_2p4t.sbatch) and gpu-check run with (scripts/gpu_requirements.py).
gpu-env:
	scripts/install_gpu.sh

# One H200, <= 8 min: SGLang logprobs, a Megatron GSPO step, weight update, switches, Mooncake pull.
gpu-check:
	scripts/gpu_check.sh

clean:
	rm -rf runs outputs .pytest_cache
