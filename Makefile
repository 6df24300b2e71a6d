# afe — the two commands are `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ENSURE_IMAGES := $(BIN)/python -c "from services.sandbox.images import ensure_images; ensure_images()"

.PHONY: run test proto proto-check lint bench images images-ready check install clean

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

# Build the Docker images that are missing (afe/base:bookworm via debootstrap,
# afe/sandbox:latest, afe/proxy:latest). AFE_BASE_IMAGE=debian:bookworm-slim
# pulls a base from a registry instead, which is much faster.
images-ready: $(STAMP)
	$(ENSURE_IMAGES)

# Rebuild the sandbox and proxy images.
images: $(STAMP)
	$(BIN)/python -c "from services.sandbox.images import ensure_images; ensure_images(force=True)"

# Start afe (all four processes) on ./afe.d, or on the bundled demo when absent.
run: $(STAMP)
	$(BIN)/afe up $(AFE_ARGS)

check: $(STAMP)
	$(BIN)/afe check $(AFE_ARGS)

# The whole suite. pytest's "no tests collected" (exit 5) is a failure too.
# Each run gets a fresh pytest base temp folder, removed afterwards by afe's own
# iterative remover: the R34 tests build 10,000-deep trees, which pytest's
# recursive clean-up of old base folders cannot remove (RecursionError). The
# name is digits only: a random mixed-case name in a path (a replay script's)
# would look like a token to the manifests' secret scan.
test: $(STAMP) proto-check images-ready
	@bt=/tmp/afe-pytest-$$$$-$$(date +%s); mkdir -p $$bt; \
	  $(BIN)/python -m pytest -ra -p no:cacheprovider --basetemp=$$bt/t $(PYTEST_ARGS); rc=$$?; \
	  $(BIN)/python -c "import sys; from services.common.treewalk import remove_tree; remove_tree(sys.argv[1])" $$bt || true; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

# ruff (default rules + B, ASYNC, SIM, RUF) and mypy (strict for services/common and
# the executor): both must pass; .ci/run runs this before the tests.
lint: $(STAMP)
	$(BIN)/ruff check services gateway tests scripts bench
	$(BIN)/mypy services gateway

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf .afe build *.egg-info
