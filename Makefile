# tokengate developer entry points. `make run` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000
ARGS ?=

.PHONY: install run test lint typecheck unit bench-backend calibration clean

$(BIN)/tokengate: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/tokengate

run: install
	$(BIN)/tokengate backend --port $(PORT) $(ARGS)

lint: install
	$(BIN)/ruff check .

typecheck: install
	$(BIN)/mypy gateway backend predictor loadtests

unit: install
	$(BIN)/pytest -q

test: lint typecheck unit

calibration: install
	$(BIN)/python -m backend.calibration

bench-backend: install
	$(BIN)/python -m loadtests.bench_backend $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
