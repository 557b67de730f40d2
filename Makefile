# Both entry points create (or reuse) .venv from the pinned requirements.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
CORES ?= 4

.PHONY: pipeline test venv clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

pipeline: $(STAMP)
	. $(VENV)/bin/activate && snakemake --cores $(CORES) $(SNAKEMAKE_ARGS)

test: $(STAMP)
	. $(VENV)/bin/activate && python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf results .snakemake

# llama.cpp (issue 22): llama-server, llama-bench and llama-batched-bench from the pinned
# llama-cpp-python sdist, built into ${SERVINGPLAN_CACHE:-$HOME/.cache/servingplan}/llamacpp-<version>
# (about 30 minutes on 2 cores; a second call does nothing).
.PHONY: llamacpp
llamacpp:
	bash scripts/build_llamacpp.sh
