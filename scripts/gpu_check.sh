#!/usr/bin/env bash
# treespec's GPU check, for the device tool's H200 machine (docs/benchmark.md, "The GPU run", says
# which device calls to make, in what order). Every stage runs under its own time limit and
# appends one JSON line per case to $OUT/results.jsonl as it goes; a stage that fails or runs
# out of time appends its error (stage, status, rc, the tail of its stderr) there and the next
# stage runs. $OUT also gets gpu_check.log (every stage's output) and summary.txt.
#
#   bash scripts/gpu_check.sh [--cpu-smoke] [STAGE ...]      (GPU_CHECK_DRY_RUN=1: --cpu-smoke)
#
# Stages (default: all but stash, in this order; named ones run in the order given), limit in s:
#   preflight  60  the default model's head layout (9/3 heads, D 64) through the Triton kernel and
#                  Target(attention_backend="triton"), against the reference: if it fails, the
#                  script stops there (GPU_CHECK_KEEP_GOING=1: it goes on); on a cold H100 the
#                  first Triton compiles alone outran 30 s (2026-12-06)
#   kernels   110  the kernel at real models' layouts against the float64 plain reference
#                  (scripts/bench_kernels.py --correctness)
#   setup      60  SmolLM2-135M-Instruct converted from the GGUF pieces in .gpu_carry/ (made by
#                  scripts/gpu_prepare.sh), when every piece is there, in the background while
#                  the next stages run (identity, bench1 and batch8 wait for it); without every
#                  piece the model stages run a random model of its config (their lines say so)
#   tests     100  pytest -m "cuda and not slow" (the slow ones need the real model)
#   identity   55  fp32 greedy tokens: Triton backend = reference backend (and HF), per method
#   bench1     70  tokens/s, bf16, batch 1: HF generate and every treespec method
#   bandwidth  25  the kernel's bandwidth on decode-shaped trees (bench_kernels.py --quick)
#   batch8     60  tokens/s, bf16, batch 8
#   stash       -  only copy what this call carries in .gpu_carry/ to $TREESPEC_GPU_STASH
# The limits add up to 540 s. Every call first copies what it carries in .gpu_carry/ to
# $TREESPEC_GPU_STASH (default /tmp/treespec_gpu), which outlives the call while the machine
# stays warm: the model's pieces can come over several calls.
#
# --cpu-smoke: the same script end to end on this CPU (TRITON_INTERPRET=1, small shapes, the
# model cut to its first 2 layers), to test the script itself (tests/test_gpu_check.py).
# Environment: OUT (default gpu_results), PYTHON, TREESPEC_HOME, TREESPEC_GPU_STASH,
# GPU_CHECK_BUDGET_S (default 540: a stage gets at most what is left of it), T_<STAGE> (one
# stage's limit, e.g. T_KERNELS=90; the dry run doubles the defaults), GPU_CHECK_FAIL=STAGE,...
# (those stages fail at once: the error path, tested), GPU_CHECK_AUTOTUNE=1 (the engine stages
# autotune the kernel; default: one fixed configuration, one compile per shape, not twelve),
# GPU_CHECK_ATTENTION=reference (bench1 and batch8 on the PyTorch reference backend: the
# fallback when the kernel fails here).
set -uo pipefail # no -e: one failed stage must not stop the others

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
ALL_STAGES=(preflight kernels setup tests identity bench1 bandwidth batch8)
SMOKE=0
[ "${GPU_CHECK_DRY_RUN:-0}" = 1 ] && SMOKE=1
STAGES=()
for arg in "$@"; do
    case $arg in
    --cpu-smoke) SMOKE=1 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | cut -c3- && exit 0 ;;
    stash | preflight | kernels | setup | tests | identity | bench1 | bandwidth | batch8) STAGES+=("$arg") ;;
    *) echo "gpu_check.sh: unknown argument $arg (see --help)" >&2 && exit 2 ;;
    esac
done
[ ${#STAGES[@]} -eq 0 ] && STAGES=("${ALL_STAGES[@]}")

MODEL=smollm2-135m-instruct
OUT=${OUT:-gpu_results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
RESULTS=$OUT/results.jsonl
LOG=$OUT/gpu_check.log
: >"$LOG"
: >"$RESULTS"
# Stage limits (s), 540 in all. The dry run doubles the defaults: the interpreter on a shared CPU
# is slow, and it tests the script, not the time.
SCALE=1
((SMOKE)) && SCALE=2
BUDGET_S=${GPU_CHECK_BUDGET_S:-$((540 * SCALE))}
declare -A LIMIT=([preflight]=${T_PREFLIGHT:-$((60 * SCALE))} [kernels]=${T_KERNELS:-$((110 * SCALE))}
    [setup]=${T_SETUP:-$((60 * SCALE))} [tests]=${T_TESTS:-$((100 * SCALE))} [identity]=${T_IDENTITY:-$((55 * SCALE))}
    [bench1]=${T_BENCH1:-$((70 * SCALE))} [bandwidth]=${T_BANDWIDTH:-$((25 * SCALE))} [batch8]=${T_BATCH8:-$((60 * SCALE))})
if ((SMOKE)); then
    DEVICE=cpu
    if [ -z "${TREESPEC_GPU_STASH:-}" ]; then # a stash of its own, removed at the end
        STASH=$(mktemp -d /tmp/treespec_gpu_smoke.XXXXXX)
        trap 'rm -rf "$STASH"' EXIT
    else
        STASH=$TREESPEC_GPU_STASH
    fi
    PY=${PYTHON:-.venv/bin/python}
    [ -x "$PY" ] || PY=python3
    export TRITON_INTERPRET=1
else
    DEVICE=cuda
    STASH=${TREESPEC_GPU_STASH:-/tmp/treespec_gpu}
    PY=${PYTHON:-python3}
fi
# The engine stages take one fixed kernel configuration unless asked (kernels/tree_attention.py);
# Triton keeps compiled kernels and autotuning results on disk for the later stages and calls.
[ "${GPU_CHECK_AUTOTUNE:-0}" = 1 ] || export TREESPEC_TRITON_AUTOTUNE=0
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_CACHE_AUTOTUNING=1
mkdir -p "$STASH"
START=$SECONDS
STOPPED=0

say() { echo "$*" | tee -a "$LOG"; }

# record STAGE STATUS RC SECONDS LIMIT STDERR_FILE [REASON]: the stage's status line in results.jsonl
record() {
    "$PY" -S -P scripts/gpu_summary.py record "$RESULTS" "$@" 2>>"$LOG" ||
        printf '{"stage": "%s", "case": "stage_status", "status": "%s", "rc": %s}\n' "$1" "$2" "${3:-null}" >>"$RESULTS"
}

injected() { [[ ",${GPU_CHECK_FAIL:-}," == *",$1,"* ]]; }

# run_stage NAME COMMAND...: COMMAND under the stage's limit (cut to what is left of the budget),
# stdout to the log as it comes, stderr to a file (appended to the log after), a status line.
run_stage() {
    local name=$1 limit=${LIMIT[$1]} left
    shift
    left=$((BUDGET_S - (SECONDS - START)))
    if ((left < 5)); then
        say "=== $name: skipped, the ${BUDGET_S}s budget is spent"
        record "$name" skipped "" 0 "$limit" "" "the ${BUDGET_S}s budget is spent"
        return 1
    fi
    ((limit > left)) && limit=$left
    if injected "$name"; then
        set -- "$PY" -S -c "import sys; sys.exit('gpu_check: failure injected into stage $name (GPU_CHECK_FAIL)')"
    fi
    say "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS err=$STASH/$name.stderr status
    GPU_CHECK_JSONL=$RESULTS GPU_CHECK_STAGE=$name timeout --kill-after=5 "$limit" "$@" 2>"$err" | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    cat "$err" >>"$LOG"
    case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
    esac
    record "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit" "$err"
    if [ "$status" != ok ]; then
        say "=== $name: $status (exit $rc) after $((SECONDS - t0))s; the end of its stderr:"
        tail -n 15 "$err"
    else
        say "=== $name: ok in $((SECONDS - t0))s"
    fi
    [ "$status" = ok ]
}

# ------------------------------------------------------------------------------ environment

say "gpu_check.sh $* at $(date -u +%FT%TZ): stages ${STAGES[*]}, device $DEVICE, budget ${BUDGET_S}s, out $OUT"

# What this call carries goes to the stash, which outlives it while the machine stays warm.
for f in .gpu_carry/part*/* .gpu_carry/extra/*; do
    [ -f "$f" ] && cp -f "$f" "$STASH/"
done
pieces() { # the GGUF pieces the list names: "have" or "missing" ones
    [ -f "$STASH/gguf_parts.txt" ] || return 0
    while read -r _ part; do
        if [ -f "$STASH/$part" ]; then [ "$1" = have ] && echo "$part"; else [ "$1" = missing ] && echo "$part"; fi
    done <"$STASH/gguf_parts.txt"
}
if [ "${STAGES[*]}" = stash ]; then
    have=$(pieces have | xargs) missing=$(pieces missing | xargs)
    say "stash $STASH holds pieces: ${have:-none}; missing: ${missing:-none}"
    printf '{"stage": "stash", "case": "pieces", "have": "%s", "missing": "%s"}\n' "$have" "$missing" >>"$RESULTS"
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

# The dry run uses the model where TREESPEC_HOME says (CI pulls it), or the random stand-in.
((SMOKE)) || export TREESPEC_HOME=${TREESPEC_HOME:-$STASH/home}
if ! "$PY" -P -c "import torch, transformers, treespec.target" 2>>"$LOG"; then
    say "$PY cannot import torch, transformers and treespec: set PYTHON to an interpreter that can"
    record environment failed 1 0 0 "$LOG" "cannot import torch, transformers and treespec"
    exit 1
fi
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    say "no CUDA device visible: use --cpu-smoke on a machine without a GPU"
    record environment failed 1 0 0 "$LOG" "no CUDA device visible"
    exit 1
fi

# ------------------------------------------------------------------------------ stages

STAGE_PY=("$PY" -P scripts/gpu_stages.py)
ATTENTION=${GPU_CHECK_ATTENTION:-triton}
JL=(--jsonl "$RESULTS")
SMALL=() # the dry run: the model cut to 2 layers, few prompts and tokens
((SMOKE)) && SMALL=(--layers 2 --num-prompts 1 --max-new-tokens 3 --budget fixed)

stage_preflight() {
    local size=(--max-new-tokens 4)
    ((SMOKE)) && size=(--max-new-tokens 3 --layers 2)
    run_stage preflight "${STAGE_PY[@]}" preflight --device "$DEVICE" "${size[@]}" "${JL[@]}" && return 0
    if [ "${GPU_CHECK_KEEP_GOING:-0}" != 1 ]; then
        say "=== preflight failed: the script stops here (GPU_CHECK_KEEP_GOING=1 goes on)"
        record gpu_check stopped "" 0 0 "" "the preflight failed; no later stage ran"
        STOPPED=1
    fi
}

stage_kernels() {
    local size=()
    ((SMOKE)) && size=(--smoke)
    run_stage kernels "$PY" -P scripts/bench_kernels.py --correctness "${size[@]}" --stage kernels "${JL[@]}"
}

stage_setup() {
    if injected setup; then
        run_stage setup "$PY" -S -c "" # fails: injected
        return
    fi
    if "$PY" -P -c "from treespec import models; import sys; sys.exit(not models.is_pulled('$MODEL'))"; then
        say "=== setup: $MODEL is already in \$TREESPEC_HOME (${TREESPEC_HOME:-~/.cache/treespec})"
        record setup ok 0 0 0 "" "$MODEL already in TREESPEC_HOME"
        return
    fi
    local missing
    missing=$(pieces missing | xargs)
    if [ ! -f "$STASH/gguf_parts.txt" ] || [ -n "$missing" ]; then
        local why="no GGUF pieces (scripts/gpu_prepare.sh makes them)"
        [ -n "$missing" ] && why="GGUF pieces missing: $missing"
        say "=== setup: skipped, $why; the model stages run a random model of $MODEL's config"
        record setup skipped "" 0 0 "" "$why"
        return
    fi
    # transformers reads GGUF files through the gguf package: install the carried wheel if missing.
    if ! "$PY" -c "import gguf" 2>/dev/null; then
        local wheels=("$STASH"/gguf-*.whl)
        [ -f "${wheels[0]}" ] && "$PY" -m pip install -q --no-index --no-deps --target "$STASH/site" "${wheels[0]}" 2>&1 | tee -a "$LOG"
    fi
    # The conversion (about 40 s, mostly the tokenizer) runs in the background under the stage's
    # limit while the next stages run; the stages that need the model wait for it (wait_setup).
    local limit=${LIMIT[setup]}
    say "=== setup (limit ${limit}s, in the background): the GGUF from $(pieces have | wc -l) pieces"
    SETUP_T0=$SECONDS
    (
        timeout --kill-after=5 "$limit" bash -c 'set -e; cd "$1"; sha256sum --quiet -c gguf_parts.txt
            cut -d" " -f3 gguf_parts.txt | xargs cat >model.gguf
            trap "rm -f model.gguf" EXIT
            cd "$2"; "$3" -P -m treespec.cli models pull "$4" --quiet --gguf "$1/model.gguf"' \
            setup "$STASH" "$ROOT" "$PY" "$MODEL" >"$STASH/setup.stdout" 2>"$STASH/setup.stderr"
        echo $? >"$STASH/setup.rc"
    ) &
    SETUP_PID=$!
}

# wait_setup: the background conversion, if one runs: wait for it and write its status line.
wait_setup() {
    [ -n "${SETUP_PID:-}" ] || return 0
    wait "$SETUP_PID"
    SETUP_PID=
    local rc status
    rc=$(cat "$STASH/setup.rc" 2>/dev/null || echo 1)
    cat "$STASH/setup.stdout" "$STASH/setup.stderr" >>"$LOG" 2>/dev/null
    case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
    esac
    record setup "$status" "$rc" "$((SECONDS - SETUP_T0))" "${LIMIT[setup]}" "$STASH/setup.stderr"
    say "=== setup: $status (exit $rc) after $((SECONDS - SETUP_T0))s"
    [ "$status" = ok ] || tail -n 15 "$STASH/setup.stderr"
}

stage_tests() {
    local where=tests
    ((SMOKE)) && where=tests/test_cuda.py # all skipped on a CPU: collect one file, not the suite
    # not slow: those need the real model, which may still be converting (identity runs the engine
    # on it instead)
    PYTHONPATH="$ROOT/scripts:$PYTHONPATH" run_stage tests "$PY" -P -m pytest "$where" -m "cuda and not slow" -q \
        -p no:cacheprovider -p gpu_stages
}

stage_identity() {
    local size=(--num-prompts 3 --max-new-tokens 32 --methods none,ngram,eagle)
    ((SMOKE)) && size=("${SMALL[@]}" --methods none,ngram)
    run_stage identity "${STAGE_PY[@]}" identity --device "$DEVICE" "${size[@]}" "${JL[@]}"
}

stage_bench1() {
    local size=(--num-prompts 3 --max-new-tokens 64 --dtype bf16 --methods none,ngram,eagle,draft,medusa,hybrid)
    ((SMOKE)) && size=("${SMALL[@]}" --dtype fp32 --methods none,ngram,eagle)
    run_stage bench1 "${STAGE_PY[@]}" speed --stage bench1 --device "$DEVICE" --batch-size 1 \
        --attention-backend "$ATTENTION" "${size[@]}" "${JL[@]}"
}

stage_bandwidth() {
    local size=(--quick)
    ((SMOKE)) && size=(--smoke)
    run_stage bandwidth "$PY" -P scripts/bench_kernels.py "${size[@]}" --stage bandwidth --out "$STASH/kernels.json" "${JL[@]}"
}

stage_batch8() {
    local prompts=() batch=8 size=(--num-prompts 16 --max-new-tokens 64 --dtype bf16 --methods none,ngram,eagle)
    [ -f "$STASH/spec_bench_subset.jsonl" ] && prompts=(--prompts "$STASH/spec_bench_subset.jsonl")
    if ((SMOKE)); then # treespec's own short prompts: Spec-Bench's are long for the interpreter
        prompts=()
        batch=2
        size=("${SMALL[@]}" --num-prompts 2 --dtype fp32 --methods none,ngram)
    fi
    run_stage batch8 "${STAGE_PY[@]}" speed --stage batch8 --device "$DEVICE" --batch-size "$batch" \
        --attention-backend "$ATTENTION" "${prompts[@]}" "${size[@]}" "${JL[@]}"
}

SETUP_PID=
for stage in "${STAGES[@]}"; do
    ((STOPPED)) && break
    [ "$stage" = stash ] && continue
    case $stage in identity | bench1 | batch8) wait_setup ;; esac
    "stage_$stage"
done
wait_setup

# ------------------------------------------------------------------------------ summary

"$PY" -S -P scripts/gpu_summary.py summary "$RESULTS" "$((SECONDS - START))" | tee "$OUT/summary.txt" | tee -a "$LOG"
((STOPPED)) && exit 3
"$PY" -S -P scripts/gpu_summary.py any-failed "$RESULTS" >/dev/null && exit 1
exit 0
