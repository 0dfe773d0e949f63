# Sourced by the experiment scripts: set up .venv (experiments/setup.sh), work from the repo root, stay
# offline and keep every cache inside the repo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash experiments/setup.sh
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
export HF_HOME=${HF_HOME:-$PWD/.cache/hf} MTEB_CACHE=${MTEB_CACHE:-$PWD/.cache/mteb}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
PY=.venv/bin/python
run() { echo; echo "+ $*"; "$@"; }
