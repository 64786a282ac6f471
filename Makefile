# The two set-up commands of README.md: `make demo` (the main job) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint typecheck broker-start broker-stop bench clean

$(BIN)/refinery: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

install: $(BIN)/refinery

demo: install
	$(BIN)/refinery demo

# the tests without a broker (CPU-bound, two xdist workers), then those against one, in one
# process: the pipeline tests need both cores (their clock bounds assume prompt sends)
test: install
	$(BIN)/pytest -q -n 2 tests/unit tests/fuzz
	$(BIN)/pytest -q tests --ignore=tests/unit --ignore=tests/fuzz

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy --strict

bench: install
	$(BIN)/refinery bench

clean:
	rm -rf $(VENV) .refinery lake .pytest_cache .mypy_cache .ruff_cache
