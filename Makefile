# afe — the two commands are `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two installs into one venv: afe alone for `make run` (no test or lint tools:
# most of a first `make run`'s time went to them), and afe with its dev extras
# for `make test`, `make lint` and the rest. The dev install counts as both.
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
ENSURE_IMAGES := $(BIN)/python -c "from services.common.host.images import ensure_images; ensure_images()"
PREFIX ?= $(HOME)/.local

.PHONY: run test test-fast proto proto-check lint bench images images-ready check install install-cli clean

$(RUN_STAMP): pyproject.toml
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then touch $(RUN_STAMP); exit 0; fi; \
	  set -e; test -x $(BIN)/python || $(PY) -m venv $(VENV); \
	  echo "installing afe into $(VENV) (runtime only; make test adds the dev tools)"; \
	  $(BIN)/pip install --quiet --upgrade pip; \
	  $(BIN)/pip install --quiet -e .; \
	  touch $(RUN_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP) $(RUN_STAMP)

install: $(STAMP)

# `afe` on your PATH, for your own repository (docs/GUIDE.md): a link to this
# checkout's .venv/bin/afe in $(PREFIX)/bin (default ~/.local/bin).
install-cli: $(RUN_STAMP)
	mkdir -p $(PREFIX)/bin
	ln -sf $(abspath $(BIN))/afe $(PREFIX)/bin/afe
	@case ":$$PATH:" in *":$(PREFIX)/bin:"*) echo "afe is on your PATH: $(PREFIX)/bin/afe";; \
	  *) echo "linked $(PREFIX)/bin/afe; add $(PREFIX)/bin to PATH (e.g. in ~/.profile) to run afe anywhere";; esac

proto: $(STAMP)
	$(BIN)/python scripts/genproto.py

proto-check: $(STAMP)
	$(BIN)/python scripts/genproto.py --check

# Build the Docker images that are missing (afe/base:bookworm via debootstrap,
# afe/sandbox:latest, afe/proxy:latest). AFE_BASE_IMAGE=debian:bookworm-slim
# pulls a base from a registry instead, which is much faster.
images-ready: $(RUN_STAMP)
	$(ENSURE_IMAGES)

# Rebuild the sandbox and proxy images.
images: $(RUN_STAMP)
	$(BIN)/python -c "from services.common.host.images import ensure_images; ensure_images(force=True)"

# Start afe (all four processes) on ./afe.d, or on the bundled demo when absent;
# more options of `afe up` in AFE_ARGS, e.g. make run AFE_ARGS="--config ./afe.d --listen 127.0.0.1:8421".
run: $(RUN_STAMP)
	$(BIN)/afe up $(AFE_ARGS)

check: $(RUN_STAMP)
	$(BIN)/afe check $(AFE_ARGS)

# The whole suite. pytest's "no tests collected" (exit 5) is a failure too.
# Each run gets a fresh pytest base temp folder, removed afterwards by afe's own
# iterative remover: the R34 tests build 10,000-deep trees, which pytest's
# recursive clean-up of old base folders cannot remove (RecursionError). The
# name is digits only: a random mixed-case name in a path (a replay script's)
# would look like a token to the manifests' secret scan. It is short (/tmp/a<pid>):
# xdist adds popen-gwN/ to every test's folder, and tests put Unix sockets there
# (at most 107 bytes for a socket's path).
# The tests run in PYTEST_WORKERS processes (pytest-xdist): most of their time is
# waiting on Docker, git, browsers and subprocesses, so more workers than cores
# pays off (tests/foundation on 2 cores: 207 s serial, 120 s with 3 workers, 117 s
# with 6, 149-211 s with 4 on a shared machine). A test file stays on one worker
# (--dist loadfile: its module fixtures, e.g. a shared sandbox or gateway, are
# made once), and the files go out in the order tests/conftest.py gives them, the
# longest first (--no-loadscope-reorder: not xdist's own order, by test count).
# PYTEST_ARGS="-n 0" runs serially.
# --durations lists the slowest tests at the end of the log.
# --max-worker-restart=0: a worker that crashes (a segmentation fault) ends the run
# at once, failed, with the test it ran and its threads' stacks printed
# (tests/support/crashlog.py); xdist 3.8 replacing it under --dist loadfile could
# leave the run waiting forever for work it never hands out.
PYTEST_WORKERS ?= 3
PYTEST_DIST ?= loadfile
test: $(STAMP) proto-check images-ready
	@bt=/tmp/a$$$$; $(BIN)/python -c "import sys; from services.common.treewalk import remove_tree; remove_tree(sys.argv[1])" $$bt 2>/dev/null; mkdir -p $$bt; \
	  $(BIN)/python -m pytest -ra -p no:cacheprovider --basetemp=$$bt/t -n $(PYTEST_WORKERS) \
	    --dist $(PYTEST_DIST) --no-loadscope-reorder --max-worker-restart=0 --durations=40 $(PYTEST_ARGS); rc=$$?; \
	  $(BIN)/python -c "import sys; from services.common.treewalk import remove_tree; remove_tree(sys.argv[1])" $$bt || true; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

# The inner loop: every test that needs nothing outside Python -- no Docker, browser,
# PostgreSQL or other process (git, an afe process, an agent) -- and takes no seconds
# (not `slow`). tests/needs.txt says which tests need a database or a process; a fast
# run refuses both, so a test that needs one and is not listed fails naming what to
# do (tests/support/needs.py). Bytecode is cached (collection: ~7 s instead of ~17 s).
# CI runs `make test`: everything.
test-fast: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE AFE_TEST_FAST=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n 2 \
	  -m "not docker and not browser and not database and not processes and not slow" $(PYTEST_ARGS)

# ruff (default rules + B, ASYNC, SIM, RUF) and mypy --strict over all product code
# (services/, gateway/): both must pass; .ci/run runs this before the tests.
lint: $(STAMP)
	$(BIN)/ruff check services gateway tests scripts bench
	$(BIN)/mypy services gateway

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf .afe build *.egg-info
