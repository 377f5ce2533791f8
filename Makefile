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

.PHONY: install demo test test-fast clean

# pip byte-compiles what it installs one file at a time (most of an install's time); this does the
# same on every core, once, after the last package. Like pip's own step, it leaves a file that is
# not Python 3.11 uncompiled (torch ships one written for 3.12), hence the `|| true`.
SITE_BYTECODE := $(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	>/dev/null || true

install: $(STAMP)

$(STAMP): setup.py requirements-cpu.txt
	test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --upgrade pip setuptools wheel
	$(PY) -m pip install -q --no-compile torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q --no-compile -r requirements-cpu.txt
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-compile --no-build-isolation deepspeed==0.19.8
	$(PY) -m pip install -q --no-compile --no-deps --no-build-isolation -e .
	$(SITE_BYTECODE)
	touch $(STAMP)

# Byte-compile the package before the many processes a demo or the suite starts: where
# PYTHONDONTWRITEBYTECODE is set (it is on the machines this project is built on), every process
# would otherwise compile all of it from source again (~0.3 s of CPU each). The cache is ignored by git (__pycache__/).
BYTECODE := $(PY) -m compileall -q -j 0 ds_trhash kernels launch >/dev/null

demo: $(STAMP)
	$(BYTECODE)
	$(PY) -m ds_trhash.cli demo

# Three workers on CI's two cores, whole files each (module fixtures share their launches): many
# launches spend part of their time waiting (for a step, a signal, a checkpoint, a stalled
# download), and a third worker keeps both cores busy meanwhile (measured: 1 % idle against 12 %
# with two workers). The work units (files, or files sharing a launching session fixture):
# tests/schedule.py.
DIST := -n 3 --dist loadfile
test: $(STAMP)
	$(BYTECODE)
	$(PY) -m pytest -q $(DIST) tests

# The inner loop: every in-process test, no training launch (those carry the `launch` marker,
# pytest.ini); the same workers. `make test` is still what CI runs.
test-fast: $(STAMP)
	$(BYTECODE)
	$(PY) -m pytest -q $(DIST) -m "not launch" tests

clean:
	rm -rf $(VENV) runs build *.egg-info
