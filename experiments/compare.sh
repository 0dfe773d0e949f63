#!/usr/bin/env bash
# CPU-scale reproduction of the paper's comparison (Tables 1 and 3): the same groups, steps, batch,
# learning-rate schedule and retention term for every objective; only the objective changes.
#   groups  : select_groups.py on the FineWeb (legal-leaning) and C4 samples of ../shared/data
#   runs    : xprt, contrastive_random_span, self_reconstruction, xprt --no_fill_in, xprt --positive random,
#             and xprt with the fresh decoder / MLM head at HEAD_LR (not in the paper; our fix for the fresh head)
#   scoring : evaluate.py on SciFact, STS-B, SICK-R, STS12-16 and Banking77 of ../shared/data (mteb metrics)
# Knobs (environment): SHARED (../shared/data), OUT (outputs/compare), STEPS, BATCH, LR, MAXLEN, DOCS,
# HEAD_LR (1e-3), EVAL_LIMIT (queries / pairs / test texts per task; empty = full sets), CORPUS_LIMIT (retrieval corpus
# size with EVAL_LIMIT; every relevant document is kept).
source "$(dirname "$0")/env.sh"
SHARED=${SHARED:-../shared/data}
OUT=${OUT:-outputs/compare}
MODEL=all-MiniLM-L6-v2
STEPS=${STEPS:-40}
BATCH=${BATCH:-16}
LR=${LR:-2e-5}
MAXLEN=${MAXLEN:-128}
DOCS=${DOCS:-600}
EVAL_LIMIT=${EVAL_LIMIT:-500}
CORPUS_LIMIT=${CORPUS_LIMIT:-2000}
HEAD_LR=${HEAD_LR:-1e-3}
mkdir -p "$OUT"

# 1. Groups: the first $DOCS FineWeb documents and the first $DOCS/2 C4 documents, MiniLM threshold
#    set from the corpus (experiments/select_fineweb/README.md: 0.825 is E5's number).
head -n "$DOCS" "$SHARED/fineweb_legal_sample/docs.jsonl" > "$OUT/train_docs.jsonl"
head -n $((DOCS / 2)) "$SHARED/c4_sample/docs.jsonl" >> "$OUT/train_docs.jsonl"
[ -f "$OUT/groups/stats.json" ] || run $PY select_groups.py --input "$OUT/train_docs.jsonl" \
    --model_name_or_path $MODEL --anchor_share 0.5 --calibration_docs 150 --output_dir "$OUT/groups" --overwrite

# 2. One run per objective, everything else equal (retention 40 -> 0 for all, the paper's setting).
train() {  # name, extra flags...
  local name=$1; shift
  [ -f "$OUT/$name/model/config.json" ] || run $PY train.py --model_name_or_path $MODEL \
      --groups_dir "$OUT/groups" --output_dir "$OUT/$name" --max_train_steps $STEPS \
      --per_device_train_batch_size $BATCH --learning_rate $LR --max_length $MAXLEN \
      --seed 42 --logging_steps 5 --report_to none --overwrite "$@"
}
train xprt
train contrastive_random_span --objective contrastive_random_span
train self_reconstruction --objective self_reconstruction
train xprt_no_fill_in --no_fill_in
train xprt_random_positive --positive random
train xprt_head_lr --head_learning_rate $HEAD_LR

# 3. One table: start model first, so every difference is to it.
LIMIT_FLAGS=()
[ -n "$EVAL_LIMIT" ] && LIMIT_FLAGS=(--limit "$EVAL_LIMIT" --corpus_limit "$CORPUS_LIMIT")
run $PY evaluate.py --models $MODEL "$OUT/xprt/model" "$OUT/contrastive_random_span/model" \
    "$OUT/self_reconstruction/model" "$OUT/xprt_no_fill_in/model" "$OUT/xprt_random_positive/model" "$OUT/xprt_head_lr/model" \
    --local_tasks "$SHARED/scifact" "$SHARED/stsbenchmark" "$SHARED/sick" "$SHARED/sts12" "$SHARED/sts13" \
    "$SHARED/sts14" "$SHARED/sts15" "$SHARED/sts16" "$SHARED/banking77" \
    "${LIMIT_FLAGS[@]}" --output_dir "$OUT/eval" --overwrite
