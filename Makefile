# Two commands on a fresh machine: `make run` (the embedded CPU default) and `make test`.
# Each sets up .venv first. torch is pinned only here, inside our own venv, so CI and
# newcomers get a known build quickly; a GPU host's own torch is used when DFLASH_TORCH=system.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup run test bench-ring clean-venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(if $(filter system,$(DFLASH_TORCH)),--system-site-packages,) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/dflash-ring run

test: setup
	$(PY) -m pytest -q

bench-ring: setup
	$(VENV)/bin/dflash-ring bench ring --json

clean-venv:
	rm -rf $(VENV)
