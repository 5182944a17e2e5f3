# Two entry points (see README): `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SRC    := kvconnect tests bench

.PHONY: run test lint bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# The tiny model (random weights, byte tokenizer) at TP=2, KV events on loopback; the same
# prompts twice, so the second run hits the prefix cache. Ends with what was published.
RUN_EVENTS := {"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kvconnect"}
run: $(STAMP)
	$(BIN)/kvconnect generate --model tiny --tp 2 --repeat 2 --max-tokens 16 \
		--kv-events-config '$(RUN_EVENTS)' \
		--prompt "You are a helpful assistant. Answer briefly. What is a KV cache?" \
		--prompt "You are a helpful assistant. Answer briefly. Why route by prefix?"

lint: $(STAMP)
	$(BIN)/ruff check $(SRC)
	$(BIN)/ruff format --check $(SRC)
	$(BIN)/mypy

# The redis tier's tests start their own redis-server; install Debian's when it is missing.
test: lint
	@command -v redis-server >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)
	$(BIN)/pytest -q

bench: $(STAMP)
	@for b in bench/*.py; do $(BIN)/python $$b; done
