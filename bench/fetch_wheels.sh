#!/usr/bin/env bash
# Dev-machine side of a GPU session: the wheels the device image lacks, into .whl/, and the
# November anchor script (../shared/bench/ref_step.py, not part of the repo) into .ref/; both
# folders are git-ignored and travel as the device call's carry [".whl", ".ref"].
# The device has python 3.12, torch 2.11 and triton 3.6 but no DeepSpeed, Liger, hjson or pydantic.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 liger-kernel==0.8.5
REF=${REF:-../shared/bench/ref_step.py}
[ -f "$REF" ] || REF=/work/shared/bench/ref_step.py
mkdir -p .ref
if [ -f "$REF" ]; then cp "$REF" .ref/ref_step.py; else echo "no $REF: the session skips ref_step.py" >&2; fi
ls .whl .ref
du -sh .whl .ref
