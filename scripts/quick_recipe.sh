#!/usr/bin/env bash
# The quick recipe (issue 15; docs/training.md): an EAGLE head for a model from nothing but the
# model, in one command (18 minutes on a 2-core Xeon with AMX, 2026-12-05). It runs the same stages as the
# full data run (scripts/data_run.sh), smaller, then trains and measures the head:
#
#   1. prompts: the built-in ones, then the target writes its own (Magpie) up to PROMPTS in all;
#   2. answers: the target answers them at large batch until ANSWER_TOKENS;
#   3. features: hidden states at prefill speed;
#   4. train: EAGLE-1, EPOCHS epochs (TTT > 1: with the training-time test of TTT steps; off by
#      default, since it did not pay for this head in docs/training.md's comparison);
#   5. bench: tau at T=0 with a fixed 31-node tree, against HF generate, on BENCH_PROMPTS
#      (default: treespec bench's own prompts; no training prompt equals one of them).
#
#   scripts/quick_recipe.sh [OUT]          (default OUT: runs/quick; every stage resumes)
#
# Writes OUT/recipe.json: the settings, each stage's wall seconds, the data's size and the tau. A
# stage's seconds add up over every run of the recipe in OUT (kept in OUT/stage_seconds.tsv), so a
# recipe resumed over several sittings reports what it cost in all; bench reruns whole each time,
# so it reports its last run.
set -euo pipefail
OUT=${1:-runs/quick}
MODEL=${MODEL:-smollm2-135m-instruct}
PROMPTS=${PROMPTS:-1200}
ANSWER_TOKENS=${ANSWER_TOKENS:-150000}
BATCH=${BATCH:-64}
MAX_NEW=${MAX_NEW:-256}
EPOCHS=${EPOCHS:-4}
TTT=${TTT:-1}
BENCH_PROMPTS=${BENCH_PROMPTS:-}
BENCH_ARGS=${BENCH_ARGS:-}
TREESPEC=${TREESPEC:-treespec}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
declare -A seconds
ledger=$OUT/stage_seconds.tsv
stage() {  # stage NAME COMMAND...: run it; seconds[NAME] = its wall seconds over every run in OUT
  local name=$1 start took before
  shift
  start=$(date +%s)
  "$@"
  took=$(( $(date +%s) - start ))
  before=0
  [[ -f $ledger && $name != bench ]] && before=$(awk -F'\t' -v n="$name" '$1 == n {s += $2} END {print s + 0}' "$ledger")
  printf '%s\t%s\n' "$name" "$took" >> "$ledger"
  seconds[$name]=$(( before + took ))
  echo "quick recipe: $name took $took s (${seconds[$name]} s over every run in $OUT)"
}
held=()
[[ -n $BENCH_PROMPTS ]] && held=(--held-out "$BENCH_PROMPTS")
stage prompts $TREESPEC train-heads prompts --model "$MODEL" --corpus "$OUT/corpus" --count "$PROMPTS" \
  --batch-size "$BATCH" "${held[@]}"
stage answers $TREESPEC train-heads answers --model "$MODEL" --corpus "$OUT/corpus" \
  --answer-tokens "$ANSWER_TOKENS" --batch-size "$BATCH" --max-new-tokens "$MAX_NEW"
stage features $TREESPEC train-heads features --model "$MODEL" --corpus "$OUT/corpus" --out "$OUT/data"
resume=()
[[ -f $OUT/eagle/checkpoint.pt ]] && resume=(--resume)
stage train $TREESPEC train-heads train --kind eagle --model "$MODEL" --data "$OUT/data" --out "$OUT/eagle" \
  --epochs "$EPOCHS" --ttt-steps "$TTT" --eval-prompts 0 "${resume[@]}"
bench_prompts=()
[[ -n $BENCH_PROMPTS ]] && bench_prompts=(--prompts "$BENCH_PROMPTS")
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
stage bench $TREESPEC bench --model "$MODEL" --proposer eagle --baselines hf --budget fixed \
  --heads "eagle=$OUT/eagle/head" --json "$OUT/bench.json" --no-plot "${bench_prompts[@]}" $BENCH_ARGS
$PYTHON - "$OUT" "${seconds[prompts]}" "${seconds[answers]}" "${seconds[features]}" "${seconds[train]}" \
  "${seconds[bench]}" "$PROMPTS" "$ANSWER_TOKENS" "$EPOCHS" "$TTT" "$MODEL" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
names = ("prompts", "answers", "features", "train", "bench")
wall = dict(zip(names, map(float, sys.argv[2:7])))
bench = json.loads((out / "bench.json").read_text())
eagle = next(m for m in bench["methods"] if m["name"] == "eagle")
report = json.loads((out / "eagle" / "report.json").read_text())
recipe = {
    "model": sys.argv[11],
    "settings": {"prompts": int(sys.argv[7]), "answer_tokens": int(sys.argv[8]), "epochs": int(sys.argv[9]),
                 "ttt_steps": int(sys.argv[10])},
    "wall_s": wall | {"data_and_training": sum(wall[n] for n in names[:4]), "all": sum(wall.values())},
    "runs": sum(line.startswith("prompts\t") for line in (out / "stage_seconds.tsv").read_text().splitlines()),
    "answer_tokens": report["answer_tokens"],
    "tau": eagle["mean_accepted_tokens"],
    "tau_per_category": {c: v["tau"] for c, v in eagle["per_category"].items()},
    "identical_to_reference": eagle["identical_to_reference"],
}
(out / "recipe.json").write_text(json.dumps(recipe, indent=1))
print(f"quick recipe: {recipe['answer_tokens']} answer tokens, data and training "
      f"{recipe['wall_s']['data_and_training'] / 60:.1f} min, tau {recipe['tau']:.2f} -> {out / 'recipe.json'}")
EOF
