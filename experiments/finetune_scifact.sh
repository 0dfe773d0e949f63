#!/usr/bin/env bash
# "Does the gain survive fine-tuning?" (the xPRT paper's open question), with PAIR's loss:
#   start model (all-MiniLM-L6-v2) -> fine-tune on SciFact train (alpha = 0 and alpha = 0.1) -> score on SciFact test;
#   the xPRT model (XPRT_MODEL, default outputs/paper/compare/s42/xprt/model, the xprt arm of
#   `python -m experiments.paper.run --scale compare`; XPRT_MODEL=none skips it) -> the same fine-tuning -> the same
#   scoring.
# Same data, negatives window, batch, epochs and lr for every run; one table from evaluate.py at the end, then the
# mean and spread of each arm over SEEDS (a one-epoch fine-tune moves by about a point from seed to seed).
# Knobs: SHARED (../shared/data), OUT (outputs/finetune), XPRT_MODEL, EPOCHS (1), BATCH (32), SEEDS ("42"),
# MINILM_SEEDS (SEEDS; the start-model arm's seeds, e.g. to add seeds to an earlier run of that arm).
source "$(dirname "$0")/env.sh"
SHARED=${SHARED:-../shared/data}
OUT=${OUT:-outputs/finetune}
XPRT_MODEL=${XPRT_MODEL:-outputs/paper/compare/s42/xprt/model}
EPOCHS=${EPOCHS:-1}
BATCH=${BATCH:-32}
SEEDS=${SEEDS:-42}
MINILM_SEEDS=${MINILM_SEEDS:-$SEEDS}

finetune() {  # name, start model, alpha, seed, extra flags...
  local name=$1 start=$2 alpha=$3 seed=$4; shift 4
  [ -f "$OUT/$name/model/config.json" ] || run $PY finetune.py --model_name_or_path "$start" \
      --beir_dir "$SHARED/scifact" --output_dir "$OUT/$name" --pair_alpha "$alpha" \
      --per_device_train_batch_size $BATCH --num_train_epochs $EPOCHS --seed "$seed" --logging_steps 5 \
      --report_to none --overwrite "$@"
}
arms() {  # prefix, start model, seeds: alpha 0 and 0.1 for every seed; appends the models to MODELS
  local prefix=$1 start=$2 seeds=$3 seed sfx
  # Negatives are mined once per start model (ranks 10-100 by that model; no randomness), as their own step
  # (--mine_only), and shared by all its runs.
  local mined="$OUT/${prefix}_mined/mined_negatives.json"
  [ -f "$mined" ] || run $PY finetune.py --model_name_or_path "$start" --beir_dir "$SHARED/scifact" \
      --output_dir "$OUT/${prefix}_mined" --mine_only --report_to none --overwrite
  for seed in $seeds; do
    sfx=$([ "$seed" = 42 ] && echo "" || echo "_s$seed")
    finetune "${prefix}_a0$sfx" "$start" 0 "$seed" --mined_negatives "$mined"
    finetune "${prefix}_a0.1$sfx" "$start" 0.1 "$seed" --mined_negatives "$mined"
    MODELS+=("$OUT/${prefix}_a0$sfx/model" "$OUT/${prefix}_a0.1$sfx/model")
  done
}
MODELS=(all-MiniLM-L6-v2)
[ -f "$XPRT_MODEL/config.json" ] && MODELS+=("$XPRT_MODEL")
arms minilm all-MiniLM-L6-v2 "$MINILM_SEEDS"
[ -f "$XPRT_MODEL/config.json" ] && arms xprt "$XPRT_MODEL" "$SEEDS"
run $PY evaluate.py --models "${MODELS[@]}" --local_tasks "$SHARED/scifact" --output_dir "$OUT/eval" --overwrite
# mean +- sd over seeds per arm (the run folder name without its _sNN suffix)
$PY - "$OUT/eval/results.json" <<'PY'
import json, re, statistics, sys
scores = json.load(open(sys.argv[1]))["summary"]["average"]
arms = {}
for model, score in scores.items():
    arms.setdefault(re.sub(r"_s\d+(?=/model$)", "", model), []).append(score)
print(f"\n{'arm':<45} {'seeds':>5} {'mean':>7} {'sd':>6}  scores")
for arm, s in arms.items():
    sd = statistics.stdev(s) if len(s) > 1 else 0.0
    print(f"{arm:<45} {len(s):>5} {statistics.mean(s):7.2f} {sd:6.2f}  " + " ".join(f"{x:.2f}" for x in s))
PY
