# Two commands on a fresh machine: `make up` runs nbfleet, `make test` passes the tests.
PY ?= python3
# pytest-xdist workers; each test file runs whole on one worker (its module fixtures,
# such as a shared cluster, start once).
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadfile
# The slowest tests of each pass, printed after it: where the suite's time goes.
DURATIONS := --durations=25
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test check unit bench clean

$(STAMP): pyproject.toml requirements.lock
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip uv
	# Bytecode now: sandboxed kernels see the environment read-only and cannot write
	# it, so a package never imported outside a kernel would compile on every import.
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -r requirements.lock
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -e .
	touch $(STAMP)

## Run the whole platform (control plane + one agent, SQLite, blobs under ./.nbfleet).
up: $(STAMP)
	$(BIN)/nbfleet up

## Lint, type-check, then the whole suite on SQLite (NBFLEET_TEST_PG emptied for it), and
## again on PostgreSQL when NBFLEET_TEST_PG names a server (e.g.
## postgresql://postgres@127.0.0.1:5432/postgres): the tests of what the database
## decides; those marked no_db or db_agnostic (tests/conftest.py) would only repeat.
## Tests marked postgres_first run in the PostgreSQL pass only, when there is one.
test: check
	NBFLEET_TEST_PG= $(BIN)/python -m pytest $(XDIST) $(DURATIONS) \
		$(if $(NBFLEET_TEST_PG),-m "not postgres_first")
	@if [ -n "$$NBFLEET_TEST_PG" ]; then \
		echo "== the database tests again, on PostgreSQL ($$NBFLEET_TEST_PG)"; \
		$(BIN)/python -m pytest $(XDIST) $(DURATIONS) -m "not no_db and not db_agnostic"; \
	fi

check: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	$(BIN)/mypy --strict bench

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit

bench: $(STAMP)
	$(BIN)/python bench/cell_overhead.py
	$(BIN)/python bench/isolation.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
