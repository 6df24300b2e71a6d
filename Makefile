# afe — the two commands are `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test proto proto-check lint bench images install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

proto: $(STAMP)
	$(BIN)/python scripts/genproto.py

proto-check: $(STAMP)
	$(BIN)/python scripts/genproto.py --check

images: $(STAMP)
	$(BIN)/afe images build

run: $(STAMP)
	$(BIN)/afe up

test: $(STAMP) proto-check
	$(BIN)/python -m pytest -ra $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check services gateway tests scripts
	$(BIN)/mypy services gateway

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf .afe build *.egg-info
