# One-command set-up: `make demo` and `make test` install into .venv/ first when needed.
PY_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export DS_BUILD_OPS := 0
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# torch comes from pip's configured index unless this names another, e.g. the CPU-only wheels:
# make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

.PHONY: install demo test test-fast typecheck clean

# Bytecode. Where PYTHONDONTWRITEBYTECODE is set (it is on the machines this project is built on),
# every process of a demo or of the suite (hundreds of them) would compile each module it imports
# from source again: the processes make starts write the caches instead. pip would byte-compile
# every file it installs (14,000, one at a time; most are never imported here), so the install
# skips that and imports what every launch and test process imports, once, writing their caches
# (about 3,300 files); a module first imported later is cached by the process that imports it.
export PYTHONDONTWRITEBYTECODE :=
WARM_IMPORTS := torch._dynamo, transformers, datasets, pyarrow, huggingface_hub, tokenizers, safetensors, rich, \
	yaml, triton, liger_kernel, matplotlib.pyplot, tensorboard, pytest, xdist

PIP := $(PY) -m pip install -q --no-compile
# The install keeps both cores busy: pip unpacks one package at a time, so three sets that share
# no package install side by side (torch, the Triton compiler, everything else that needs
# neither); then one resolution over the whole list adds torch's own requirements and
# liger-kernel (and checks the set). DeepSpeed builds from its source distribution while the
# common imports write their bytecode.
REST := $(VENV)/requirements-without-torch.txt

install: $(STAMP)

$(STAMP): setup.py requirements-cpu.txt
	test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PIP) --upgrade pip setuptools wheel
	grep -v -E '^(triton|liger-kernel)\b' requirements-cpu.txt > $(REST)
	$(PIP) --no-deps torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) & torch=$$!; \
	$(PIP) --no-deps $$(grep -E '^triton\b' requirements-cpu.txt) & triton=$$!; \
	$(PIP) -r $(REST); rest=$$?; wait $$torch && wait $$triton && test $$rest -eq 0
	$(PIP) torch==2.13.0 -r requirements-cpu.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	DS_BUILD_OPS=0 $(PIP) --no-build-isolation deepspeed==0.19.8 & ds=$$!; \
	$(PY) -c 'import $(WARM_IMPORTS)' >/dev/null; warm=$$?; wait $$ds && test $$warm -eq 0
	$(PIP) --no-deps --no-build-isolation -e .
	$(PY) -c 'import deepspeed, ds_trhash.cli' >/dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m ds_trhash.cli demo

# Three workers on CI's two cores, whole files each (module fixtures share their launches): many
# launches spend part of their time waiting (for a step, a signal, a checkpoint, a stalled
# download), and a third worker keeps both cores busy meanwhile (measured: 1 % idle against 12 %
# with two workers). The work units (files, or files sharing a launching session fixture):
# tests/schedule.py.
DIST := -n 3 --dist loadfile
# The type checker (mypy.ini) runs beside the suite, its report printed after it: one process on
# the two cores the workers keep busy costs less wall time than running it first (measured in
# docs/operations.md, "Installing"). Either failing fails `make test`.
TYPECHECK_LOG := $(VENV)/typecheck.log
test: $(STAMP)
	$(MAKE) -s typecheck > $(TYPECHECK_LOG) 2>&1 & typecheck=$$!; \
	$(PY) -m pytest -q $(DIST) tests; tests=$$?; \
	wait $$typecheck; typed=$$?; cat $(TYPECHECK_LOG); test $$tests -eq 0 && test $$typed -eq 0

# mypy over ds_trhash/ and kernels/ (as ds_trhash.kernels: linked under build/typecheck/, mypy.ini)
typecheck: $(STAMP)
	mkdir -p build/typecheck/ds_trhash && ln -sfn ../../../kernels build/typecheck/ds_trhash/kernels
	$(PY) -m mypy

# The inner loop: every in-process test, no training launch (those carry the `e2e` marker,
# pytest.ini); the same workers. `make test` is still what CI runs.
test-fast: $(STAMP)
	$(PY) -m pytest -q $(DIST) -m "not e2e" tests

clean:
	rm -rf $(VENV) runs build *.egg-info
