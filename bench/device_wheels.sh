#!/usr/bin/env bash
# The wheels bench/device_check.py installs offline on a GPU machine that lacks datasets and mteb (the lent one has
# torch, transformers, accelerate, sentence-transformers, pyarrow, scikit-learn; no registry): Python 3.12, x86-64.
# Run here (the registry is reachable), then carry bench/wheels (git ignores it): about 42 MB with polars 1.0, the
# oldest mteb 2.26 accepts (polars 2's runtime wheel alone is 54 MB, over the 64 MiB a run may carry).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p wheels
PIP=${PIP:-../.venv/bin/pip}
$PIP download -q --no-deps -d wheels --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    datasets==5.2.0 mteb==2.26.24 "polars==1.0.0" dill multiprocess pydantic pydantic-core pytrec-eval-terrier \
    eval-type-backport annotated-types typing-inspection
du -sh wheels
