#!/usr/bin/env bash
# EAGLE-3 against EAGLE-1 at equal data (issue 38; docs/training.md): one learning curve per
# kind on the same data folder (written by `treespec train-heads features --eagle3`), point by
# point so both kinds have a point before either has the next. Each point trains the kind's own
# recipe (EAGLE-1: no training-time test; EAGLE-3: TTT_STEPS steps of it) for EPOCHS epochs at
# PRECISION, then is measured at 31 drafted nodes T=0 and at SETTINGS (nodes:temperature) on
# BENCH_PROMPTS. Finished points are kept and an interrupted one resumes from its checkpoint:
# run the same command again.
#
#   scripts/eagle_kinds.sh [DATA] [OUT]        (defaults: runs/data, runs/kinds)
#
# Writes OUT/eagle and OUT/eagle3 (curve.json, curve.md, curve.png; EAGLE-3's plot draws EAGLE-1's
# curve beside its own).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
DATA=${1:-runs/data}
OUT=${2:-runs/kinds}
POINTS=${POINTS:-200000,1000000}
EPOCHS=${EPOCHS:-4}
TTT_STEPS=${TTT_STEPS:-3}
PRECISION=${PRECISION:-bf16}
SETTINGS=${SETTINGS:-8:0 31:1 8:1}
PER_CATEGORY=${PER_CATEGORY:-4}
NEW_TOKENS=${NEW_TOKENS:-128}
BENCH_PROMPTS=${BENCH_PROMPTS:-$here/../../shared/data/prompts/spec_bench/question_no_mtbench.jsonl}
MODEL=${MODEL:-smollm2-135m-instruct}
PYTHON=${PYTHON:-python3}
bench_prompts=()
[[ -f $BENCH_PROMPTS ]] && bench_prompts=(--prompts "$BENCH_PROMPTS")
read -ra settings <<< "$SETTINGS"

curve() {  # curve KIND TTT POINTS [--beside DIR]
  local kind=$1 ttt=$2 points=$3
  shift 3
  $PYTHON "$here/learning_curve.py" --model "$MODEL" --data "$DATA" --out "$OUT/$kind" --kind "$kind" \
    --points "$points" --ttt-steps "$ttt" --epochs "$EPOCHS" --precision "$PRECISION" \
    --per-category "$PER_CATEGORY" --new-tokens "$NEW_TOKENS" --settings "${settings[@]}" "${bench_prompts[@]}" "$@"
}
done_points=
IFS=, read -ra points <<< "$POINTS"
for point in "${points[@]}"; do
  done_points=${done_points:+$done_points,}$point
  curve eagle 1 "$done_points"
  curve eagle3 "$TTT_STEPS" "$done_points" --beside "$OUT/eagle"
done
