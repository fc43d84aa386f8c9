#!/usr/bin/env bash
# The self-distilled training corpus for smollm2-135m-instruct (docs/training.md), kept in the
# repository: every prompt round and every 500 answers are sealed into a shard under STORE and
# committed (COMMIT=1), so a cut sitting loses at most one shard. Run the same command again after
# a kill or on a new machine: the working folder is rebuilt from the shards and each stage resumes.
#
#   scripts/data_run.sh [CORPUS] [DATA]        (defaults: runs/corpus, runs/data)
#
# Benchmark prompt files given in HELD_OUT (colon list; default: the Spec-Bench and GSM8K files in
# ../shared when they exist) are held out: no prompt equal or near one of them is kept.
# FEATURES=0 skips the last stage (the hidden states, recomputed from the corpus, never committed);
# EAGLE3=1 adds the fused layers EAGLE-3 reads, FEATURES_DTYPE (fp32) is the target's dtype there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
CORPUS=${1:-runs/corpus}
DATA=${2:-runs/data}
STORE=${STORE:-$here/../heads/corpus/smollm2-135m-instruct}
FIRST_PROMPTS=${FIRST_PROMPTS:-6000}     # written and answered before the rest
ALL_PROMPTS=${ALL_PROMPTS:-20000}
ANSWER_TOKENS=${ANSWER_TOKENS:-3200000}
FOLLOW_UP_SHARE=${FOLLOW_UP_SHARE:-0.1}
COMMIT=${COMMIT:-1}
FEATURES=${FEATURES:-1}
EAGLE3=${EAGLE3:-0}
FEATURES_DTYPE=${FEATURES_DTYPE:-fp32}
TREESPEC=${TREESPEC:-treespec}
shared=$here/../../shared/data/prompts
HELD_OUT=${HELD_OUT:-$shared/spec_bench/question_no_mtbench.jsonl:$shared/gsm8k/test.jsonl}
held=()
IFS=: read -ra files <<< "$HELD_OUT"
for f in "${files[@]}"; do [[ -f $f ]] && held+=(--held-out "$f"); done
echo "$(( ${#held[@]} / 2 )) benchmark prompt files held out"
store=(--store "$STORE")
[[ $COMMIT == 1 ]] && store+=(--commit)

$TREESPEC train-heads prompts --corpus "$CORPUS" --count "$FIRST_PROMPTS" "${held[@]}" "${store[@]}"
$TREESPEC train-heads answers --corpus "$CORPUS" --answer-tokens "$ANSWER_TOKENS" "${store[@]}"
$TREESPEC train-heads prompts --corpus "$CORPUS" --count "$ALL_PROMPTS" "${held[@]}" "${store[@]}"
$TREESPEC train-heads answers --corpus "$CORPUS" --answer-tokens "$ANSWER_TOKENS" \
    --follow-up-share "$FOLLOW_UP_SHARE" "${store[@]}"
if [[ $FEATURES == 1 ]]; then
    eagle3=(); [[ $EAGLE3 == 1 ]] && eagle3=(--eagle3)
    $TREESPEC train-heads features --corpus "$CORPUS" --out "$DATA" --dtype "$FEATURES_DTYPE" \
        "${eagle3[@]}" "${store[@]}"
fi
