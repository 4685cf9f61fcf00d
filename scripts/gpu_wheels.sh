#!/usr/bin/env bash
# The wheels a GPU machine without a package registry lacks for lit_fsdp and scripts/gpu_check.py (Python 3.12,
# manylinux x86-64), downloaded here, on a machine that reaches the registry:
#   scripts/gpu_wheels.sh [FOLDER]            # default .whl (ignored by git: add /.whl/ to .git/info/exclude)
# There: python3 -m pip install --no-index --no-deps --target /tmp/site FOLDER/*.whl && export PYTHONPATH=/tmp/site
# The list is what `scripts/gpu_check.py`'s probe found missing on the machine we are lent (its torch 2.11,
# lightning 2.6, transformers 5.17, torchmetrics and PyYAML are there; wandb is not, and lit_fsdp falls back to
# the CSV logger without it). Pass PYTHON_VERSION=3.11 or more packages as NAME==VERSION after the folder.
# The peers step (scripts/bench_peers.py) needs deepspeed, and what of its requirements the image lacks: hjson and
# pydantic with its own (pydantic-core, annotated-types, typing-inspection, and typing-extensions 4.16 or later; einops,
# msgpack, ninja, psutil, py-cpuinfo are there), pinned to the releases tested together on the CPU. deepspeed 0.19's release on PyPI is a source
# distribution: its wheel is built here, pure Python (its C++ ops are built at first use, there as on the CPU). The
# float8 steps need torchao (the float8 extra's release; its float8 training is Python and Triton, so a wheel built for
# another torch still serves it).
set -euo pipefail
folder="${1:-.whl}"
shift || true
packages=(jsonargparse docstring-parser typeshed-client ijson hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5
          annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 torchao==0.18.0 "$@")
mkdir -p "$folder"
for package in "${packages[@]}"; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$folder" "$package"
done
python3 -m pip wheel --quiet --no-deps -w "$folder" deepspeed==0.19.8
ls "$folder"
