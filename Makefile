# Both entry points create (or reuse) .venv from the pinned requirements: the pipeline installs only what it
# runs with (requirements.txt; the test tools, playwright among them, added 11 s to a cold run's 72 s of
# installing), the tests add requirements-dev.txt on top.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
CORES ?= 4

.PHONY: pipeline test venv clean

venv: $(DEV_STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(DEV_STAMP): $(STAMP) requirements-dev.txt
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $(DEV_STAMP)

pipeline: $(STAMP)
	. $(VENV)/bin/activate && snakemake --cores $(CORES) $(SNAKEMAKE_ARGS)

test: $(DEV_STAMP)
	. $(VENV)/bin/activate && python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf results .snakemake

# llama.cpp (issue 22): llama-server, llama-bench and llama-batched-bench from the pinned
# llama-cpp-python sdist, built into ${SERVINGPLAN_CACHE:-$HOME/.cache/servingplan}/llamacpp-<version>
# (about 30 minutes on 2 cores; a second call does nothing).
.PHONY: llamacpp
llamacpp:
	bash scripts/build_llamacpp.sh

# Issue 36: check the GPU targets' estimates on a machine with a GPU (docs/hardware.md#checking-the-estimates-on-a-gpu).
# Runs from the source tree with the machine's own python (torch with CUDA; no venv, snakemake or jsonschema
# needed), carrying over this machine's fit and its profile's machine.json: copy results/fit/costmodel.json and
# results/profile/<fingerprint>/machine.json along. GPU_CHECK_ARGS adds flags (--device cpu --tiny: no GPU).
GPU_PYTHON ?= python3
OUT ?= results/gpu_check
CARRY_FROM ?= results/fit/costmodel.json
MACHINE_JSON ?= $(firstword $(wildcard results/profile/*/machine.json))
.PHONY: gpu-check
gpu-check:
	@test -n "$(MACHINE_JSON)" || { echo "gpu-check: no results/profile/*/machine.json; set MACHINE_JSON=..." >&2; exit 2; }
	PYTHONPATH=. $(GPU_PYTHON) -m servingplan.gpu_check --out $(OUT) --carry-from $(CARRY_FROM) \
		--machine-json $(MACHINE_JSON) $(GPU_CHECK_ARGS)
