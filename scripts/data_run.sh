#!/usr/bin/env bash
# The self-distilled training data at scale for smollm2-135m-instruct (issue 15; docs/training.md).
# Every stage resumes where it stopped: run the same command again after a kill or a new session.
#
#   scripts/data_run.sh [CORPUS] [DATA]        (defaults: runs/corpus, runs/data)
#
# Benchmark prompt files given in HELD_OUT (colon list; default: the Spec-Bench and GSM8K files in
# ../shared when they exist) are held out: no prompt equal or near one of them is kept.
set -euo pipefail
CORPUS=${1:-runs/corpus}
DATA=${2:-runs/data}
FIRST_PROMPTS=${FIRST_PROMPTS:-6000}     # written before the first answers
ALL_PROMPTS=${ALL_PROMPTS:-20000}
ANSWER_TOKENS=${ANSWER_TOKENS:-1200000}
TREESPEC=${TREESPEC:-treespec}
shared=$(dirname "$0")/../../shared/data/prompts
HELD_OUT=${HELD_OUT:-$shared/spec_bench/question_no_mtbench.jsonl:$shared/gsm8k/test.jsonl}
held=()
IFS=: read -ra files <<< "$HELD_OUT"
for f in "${files[@]}"; do [[ -f $f ]] && held+=(--held-out "$f"); done
echo "$(( ${#held[@]} / 2 )) benchmark prompt files held out"

$TREESPEC train-heads prompts --corpus "$CORPUS" --count "$FIRST_PROMPTS" "${held[@]}"
$TREESPEC train-heads answers --corpus "$CORPUS" --answer-tokens "$ANSWER_TOKENS" --follow-up-share 0.1
$TREESPEC train-heads features --corpus "$CORPUS" --out "$DATA"
$TREESPEC train-heads prompts --corpus "$CORPUS" --count "$ALL_PROMPTS" "${held[@]}"
