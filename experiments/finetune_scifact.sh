#!/usr/bin/env bash
# "Does the pre-training gain survive fine-tuning?" (the xPRT paper's open question), with PAIR's loss:
#   start model (all-MiniLM-L6-v2) -> fine-tune on SciFact train (alpha = 0 and alpha = 0.1) -> score on SciFact test;
#   the xPRT model (XPRT_MODEL, default outputs/compare/xprt/model; XPRT_MODEL=none skips it) -> the same
#   fine-tuning -> the same scoring.
# Same data, negatives window, batch, epochs and lr for every run; one table from evaluate.py at the end.
# Knobs: SHARED (../shared/data), OUT (outputs/finetune), XPRT_MODEL, EPOCHS (1), BATCH (32).
source "$(dirname "$0")/env.sh"
SHARED=${SHARED:-../shared/data}
OUT=${OUT:-outputs/finetune}
XPRT_MODEL=${XPRT_MODEL:-outputs/compare/xprt/model}
EPOCHS=${EPOCHS:-1}
BATCH=${BATCH:-32}

finetune() {  # name, start model, alpha, extra flags...
  local name=$1 start=$2 alpha=$3; shift 3
  [ -f "$OUT/$name/model/config.json" ] || run $PY train.py --stage finetune --model_name_or_path "$start" \
      --beir_dir "$SHARED/scifact" --output_dir "$OUT/$name" --pair_alpha "$alpha" \
      --per_device_train_batch_size $BATCH --num_train_epochs $EPOCHS --seed 42 --logging_steps 5 \
      --report_to none --overwrite "$@"
}
# Negatives are mined once per start model (ranks 10-100 by that model) and shared by its alpha runs.
finetune minilm_a0 all-MiniLM-L6-v2 0
finetune minilm_a0.1 all-MiniLM-L6-v2 0.1 --mined_negatives "$OUT/minilm_a0/mined_negatives.json"
MODELS=(all-MiniLM-L6-v2 "$OUT/minilm_a0/model" "$OUT/minilm_a0.1/model")
if [ -f "$XPRT_MODEL/config.json" ]; then
  finetune xprt_a0 "$XPRT_MODEL" 0
  finetune xprt_a0.1 "$XPRT_MODEL" 0.1 --mined_negatives "$OUT/xprt_a0/mined_negatives.json"
  MODELS+=("$XPRT_MODEL" "$OUT/xprt_a0/model" "$OUT/xprt_a0.1/model")
fi
run $PY evaluate.py --models "${MODELS[@]}" --local_tasks "$SHARED/scifact" --output_dir "$OUT/eval" --overwrite
