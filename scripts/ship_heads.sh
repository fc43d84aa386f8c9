#!/usr/bin/env bash
# The shipped heads (issue 15; docs/training.md), trained on the data run's features
# (scripts/data_run.sh), measured, and optionally copied into heads/shipped. Every step resumes:
# run the same command again after a kill or in a new sitting, and finished steps are kept.
#
#   scripts/ship_heads.sh [DATA] [OUT]        (defaults: runs/data, runs/shipped)
#
#   1. EAGLE: the learning curve's largest point (scripts/learning_curve.py, in CURVE), so the
#      shipped EAGLE head is the curve's last point; no training-time test, EAGLE_EPOCHS epochs;
#   2. Medusa (soft targets, MEDUSA_EPOCHS epochs: one pass over 1M tokens already takes 2.3x the
#      steps of the 200k comparison's two) and the draft (DRAFT_LAYERS layers initialised from the
#      target, DRAFT_EPOCHS epochs), each on the same TOKENS answer tokens;
#   3. bench: the three at T=0 with a fixed 31-node tree beside HF generate and HF assisted
#      generation with the new draft (OUT/bench_t0.json), then EAGLE at T=1 (OUT/bench_t1.json);
#      on BENCH_PROMPTS (default: the Spec-Bench file in ../shared, which the data run held out);
#   4. OUT/ship.json (tau and acceptance by depth per method, training per kind) and OUT/ship.md
#      (the same as docs/training.md's tables);
#   5. with SHIP=FOLDER (e.g. heads/shipped): first the heads as vLLM serves them (scripts/serve_check.py,
#      EAGLE and Medusa exported, each drafting a chain in vLLM within SERVE_GAP (5 %) of treespec's tokens
#      per step, or nothing ships; SERVE_CHECK=skip where vLLM is not installed: the exports alone, and
#      said), then copy the heads to FOLDER/MODEL-KIND (MODEL's base name).
set -euo pipefail
DATA=${1:-runs/data}
OUT=${2:-runs/shipped}
MODEL=${MODEL:-smollm2-135m-instruct}
TOKENS=${TOKENS:-1000000}
CURVE=${CURVE:-runs/curve-ttt1-4ep}
CURVE_POINTS=${CURVE_POINTS:-50000,200000}   # the curve's smaller points, kept or trained first
EAGLE_EPOCHS=${EAGLE_EPOCHS:-4}
MEDUSA_EPOCHS=${MEDUSA_EPOCHS:-1}
DRAFT_LAYERS=${DRAFT_LAYERS:-4}
DRAFT_EPOCHS=${DRAFT_EPOCHS:-1}
PER_CATEGORY=${PER_CATEGORY:-4}
BENCH_PROMPTS=${BENCH_PROMPTS:-$(dirname "$0")/../../shared/data/prompts/spec_bench/question_no_mtbench.jsonl}
BENCH_ARGS=${BENCH_ARGS:-}
SHIP=${SHIP:-}
TREESPEC=${TREESPEC:-treespec}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
bench_prompts=()
[[ -f $BENCH_PROMPTS ]] && bench_prompts=(--prompts "$BENCH_PROMPTS")

$PYTHON "$(dirname "$0")/learning_curve.py" --model "$MODEL" --data "$DATA" --out "$CURVE" \
  --points "$CURVE_POINTS,$TOKENS" --ttt-steps 1 --epochs "$EAGLE_EPOCHS" --per-category "$PER_CATEGORY" \
  "${bench_prompts[@]}"
eagle=$CURVE/eagle-$TOKENS/head
[[ -d $eagle ]] || { echo "ship_heads: $DATA holds fewer than $TOKENS answer tokens; finish the data run" >&2; exit 1; }

train() {  # train KIND FLAGS...: into OUT/KIND, resuming its checkpoint, skipped once finished
  local kind=$1 resume=()
  shift
  [[ -f $OUT/$kind/report.json ]] && return
  [[ -f $OUT/$kind/checkpoint.pt ]] && resume=(--resume)
  $TREESPEC train-heads train --kind "$kind" --model "$MODEL" --data "$DATA" --out "$OUT/$kind" \
    --data-tokens "$TOKENS" --checkpoint-every 50 --eval-prompts 0 "$@" "${resume[@]}"
}
train medusa --epochs "$MEDUSA_EPOCHS"
train draft --epochs "$DRAFT_EPOCHS" --draft-layers "$DRAFT_LAYERS"

heads=(--heads "eagle=$eagle" --heads "medusa=$OUT/medusa/head" --heads "draft=$OUT/draft/head")
bench() {  # bench NAME FLAGS...: OUT/NAME, written whole (under .part until done), skipped once there
  local name=$1
  shift
  [[ -f $OUT/$name ]] && return
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  $TREESPEC bench --model "$MODEL" --budget fixed --per-category "$PER_CATEGORY" "${heads[@]}" --no-plot \
    --json "$OUT/$name.part" "${bench_prompts[@]}" "$@" $BENCH_ARGS
  mv "$OUT/$name.part" "$OUT/$name"
}
bench bench_t0.json --proposer eagle,medusa,draft --baselines hf,hf-assisted
bench bench_t1.json --proposer eagle --baselines hf --temperature 1

$PYTHON - "$OUT" "$eagle" <<'EOF'
import json, sys
from pathlib import Path

from treespec.heads.training.train import acceptance_by_depth, expand_histogram

out, eagle = Path(sys.argv[1]), Path(sys.argv[2])
reports = {"eagle": eagle.parent / "report.json", "medusa": out / "medusa" / "report.json",
           "draft": out / "draft" / "report.json"}
summary, rows = {}, []
for temperature, name in ((0, "bench_t0.json"), (1, "bench_t1.json")):
    for m in json.loads((out / name).read_text())["methods"]:
        lengths = expand_histogram(m.get("accepted_length_histogram", {}))  # treespec methods only
        entry = summary[f"{m['name']} T={temperature}"] = {
            "tau": m["mean_accepted_tokens"],
            "tau_per_category": {c: v["tau"] for c, v in m["per_category"].items()},
            "acceptance_by_depth": acceptance_by_depth(lengths),
            "identical_to_reference": m.get("identical_to_reference"),
        }
        if m["name"] != "none":
            rows.append((m["name"], temperature, entry))
for kind, path in reports.items():
    report = json.loads(path.read_text())
    summary[kind] = {"answer_tokens": report["answer_tokens"], "positions": report["data_tokens"],
                     "trainable_params": report["trainable_params"], "steps": report["steps"],
                     "wall_s": report["wall_s"], "loss_per_epoch": [h["mean_loss"] for h in report["history"]]}
(out / "ship.json").write_text(json.dumps(summary, indent=1))

# ship.md: the two tables of docs/training.md's "Shipped heads"
categories = list(rows[0][2]["tau_per_category"])
lines = ["| method | T | tau | " + " | ".join(categories) + " | acceptance by depth (1..5) | identical |",
         "|---" * (5 + len(categories)) + "|"]
for name, temperature, e in rows:
    depth = ", ".join(f"{a:.2f}" for a in e["acceptance_by_depth"][:5]) or "-"
    same = "-" if e["identical_to_reference"] is None else f"{e['identical_to_reference']:.0%}"
    lines.append(f"| {name} | {temperature} | **{e['tau']:.2f}** | "
                 + " | ".join(f"{e['tau_per_category'][c]:.2f}" for c in categories) + f" | {depth} | {same} |")
lines += ["", "| kind | trainable params | answer tokens | positions | steps | training wall time | loss per epoch |",
          "|---" * 7 + "|"]
for kind in reports:
    k = summary[kind]
    lines.append(f"| {kind} | {k['trainable_params'] / 1e6:.1f} M | {k['answer_tokens']:,} | {k['positions']:,} | "
                 f"{k['steps']:,} | {k['wall_s'] / 60:.1f} min | "
                 + ", ".join(f"{x:.3f}" for x in k["loss_per_epoch"]) + " |")
(out / "ship.md").write_text("\n".join(lines) + "\n")
for name, temperature, e in rows:
    print(f"ship_heads: {name} T={temperature}: tau {e['tau']:.2f}")
EOF

if [[ -n $SHIP ]]; then
  serve=(--max-gap "${SERVE_GAP:-0.05}")
  if [[ ${SERVE_CHECK:-vllm} == skip ]]; then
    serve=(--no-vllm)
    echo "ship_heads: SERVE_CHECK=skip: the heads are exported and read back, but not run in vLLM" >&2
  fi
  $PYTHON "$(dirname "$0")/serve_check.py" --model "$MODEL" --heads "eagle=$eagle" "medusa=$OUT/medusa/head" \
    --out "$OUT/serve_check" --json "$OUT/serve_check.json" "${serve[@]}"
  name=$(basename "$MODEL")  # a registered name, or a local folder's name
  for kind in eagle medusa draft; do
    src=$OUT/$kind/head
    [[ $kind == eagle ]] && src=$eagle
    mkdir -p "$SHIP/$name-$kind"
    rm -f "$SHIP/$name-$kind"/*
    cp "$src"/* "$SHIP/$name-$kind/"
  done
  du -sh "$SHIP/$name"-*
fi
