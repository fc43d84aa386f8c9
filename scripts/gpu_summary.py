"""The results file of scripts/gpu_check.sh ($OUT/results.jsonl): its stage status lines, and the
short summary at the end. Standard library only (it runs as ``python -S``, also where torch
cannot be imported).

    python scripts/gpu_summary.py record RESULTS STAGE STATUS RC SECONDS LIMIT [STDERR_FILE [REASON]]
    python scripts/gpu_summary.py summary RESULTS SECONDS
    python scripts/gpu_summary.py any-failed RESULTS    # exit 0 if a stage failed or ran out of time

Every line of RESULTS is a JSON object with ``stage`` and ``case``. The stages write their cases
as they go; after each stage the script appends its status line, ``case`` "stage_status", with
``status`` ok, failed, timeout, skipped or stopped, ``rc``, ``seconds``, ``limit_s``, and on
failure ``stderr_tail`` (the last lines of the stage's stderr).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

BAD = ("failed", "timeout", "stopped")


def record(results: str, stage: str, status: str, rc: str, seconds: str, limit: str, stderr: str = "",
           reason: str = "") -> None:  # fmt: skip
    line = {"stage": stage, "case": "stage_status", "status": status, "rc": int(rc) if rc.strip() else None,
            "seconds": int(seconds or 0), "limit_s": int(limit or 0)}  # fmt: skip
    if reason:
        line["reason"] = reason
    if status in BAD and stderr and Path(stderr).is_file():
        lines = Path(stderr).read_text(errors="replace").splitlines()
        line["stderr_tail"] = "\n".join(lines[-40:])[-4000:]
    with open(results, "a") as f:
        f.write(json.dumps(line) + "\n")


def read(results: str) -> list[dict]:
    rows = []
    for text in Path(results).read_text(errors="replace").splitlines():
        try:
            row = json.loads(text)
        except ValueError:  # a line cut short by a kill: skip it
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def fmt(x, spec=".1f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def headline(stage: str, rows: list[dict]) -> list[str]:
    """A few lines of what a stage measured."""
    cases = [r for r in rows if r.get("case") != "stage_status"]
    by_case = defaultdict(list)
    for r in cases:
        by_case[r.get("case")].append(r)
    lines = []
    for r in by_case.get("error", []):
        lines.append(f"error: {r.get('error')}")
    if stage == "preflight":
        for r in by_case.get("environment", []):
            lines.append(f"{r.get('device')}: torch {r.get('torch')}, triton {r.get('triton')}, "
                         f"transformers {r.get('transformers')}, real model: {r.get('real_model')}")  # fmt: skip
        for r in by_case.get("kernel", []):
            lines.append(f"kernel at {r['heads']}/{r['kv_heads']} D {r['dim']} ({r['model']}): "
                         f"max |err| {r['max_abs_error']:.2e}, {'ok' if r['ok'] else 'MISS'}")  # fmt: skip
        for r in by_case.get("summary", []):
            lines.append(f"generate: triton == reference: {r['triton_equals_reference']}")
    elif stage in ("kernels", "bandwidth"):
        checked = by_case.get("correctness", []) + by_case.get("bandwidth", [])
        if checked:
            misses = [r for r in checked if not r.get("ok")]
            worst = Counter()
            for r in checked:
                worst[r.get("dtype", "?")] = max(worst[r.get("dtype", "?")], r.get("max_abs_error") or 0.0)
            errors = ", ".join(f"{d} {e:.1e}" for d, e in sorted(worst.items()))
            lines.append(f"{len(checked)} cases, {len(misses)} not ok; worst |err| {errors}")
            for r in misses[:5]:
                what = " ".join(f"{k}={r[k]}" for k in ("heads", "kv_heads", "dim", "dtype", "launch", "num_splits",
                                                        "kind", "batch", "prefix", "nodes") if k in r)  # fmt: skip
                lines.append(f"  not ok: {what}: {r.get('error') or fmt(r.get('max_abs_error'), '.2e')}")
        for r in by_case.get("copy_bandwidth", []):
            lines.append(f"copy bandwidth {r['gb_per_s']:.0f} GB/s on {r['device']}")
        timed = [r for r in by_case.get("bandwidth", []) if "bandwidth_fraction" in r]
        if timed:
            fractions = [r["bandwidth_fraction"] for r in timed]
            vs_sdpa = [r["speedup"]["sdpa_mask"] for r in timed]
            lines.append(f"bandwidth {min(fractions):.0%}-{max(fractions):.0%} (median "
                         f"{statistics.median(fractions):.0%}), vs SDPA+mask {min(vs_sdpa):.2f}x-{max(vs_sdpa):.2f}x")  # fmt: skip
    elif stage == "tests":
        outcomes = Counter(r.get("outcome") for r in cases if r.get("case") != "session")
        if outcomes:
            lines.append(", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())))
        for r in cases:
            if r.get("outcome") in ("failed", "error"):
                lines.append(f"  {r.get('outcome')}: {r.get('case')}")
    elif stage == "identity":
        rows_ = by_case.get("identity", [])
        if rows_:
            same = sum(r["triton_equals_reference"] for r in rows_)
            hf = sum(r["triton_equals_hf"] for r in rows_)
            lines.append(f"{rows_[0]['model']}: triton == reference on {same}/{len(rows_)} (method, prompt), "
                         f"== HF generate on {hf}/{len(rows_)}")  # fmt: skip
    elif stage in ("bench1", "batch8"):
        for r in by_case.get("speed_total", []):
            lines.append(f"{r['method']:<8} {r['tokens_per_s']:8.1f} tok/s {r['speedup_vs_hf']:5.2f}x HF "
                         f"(batch {r['batch_size']}, {r['dtype']}, same as treespec AR {r['same_as_treespec_ar']:.2f})")  # fmt: skip
        if not by_case.get("speed_total") and by_case.get("speed"):
            lines.append(
                f"{len(by_case['speed'])} runs measured before it stopped (per-run lines in the file)"
            )
    elif stage == "stash":
        for r in by_case.get("pieces", []):
            lines.append(f"pieces here: {r.get('have') or 'none'}; missing: {r.get('missing') or 'none'}")
    return lines


def summary(results: str, seconds: str) -> None:
    rows = read(results)
    by_stage: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_stage[str(r.get("stage"))].append(r)
    print(f"=== summary ({seconds}s in all; {len(rows)} lines in {results})")
    for stage, stage_rows in by_stage.items():
        statuses = [r for r in stage_rows if r.get("case") == "stage_status"]
        status = statuses[-1] if statuses else {"status": "running (no status line)"}
        took = f"{status['seconds']}s/{status['limit_s']}s" if "seconds" in status else ""
        why = f"  {status['reason']}" if status.get("reason") else ""
        print(f"{stage:<10} {status['status']:<8} {took:>9}{why}")
        for line in headline(stage, stage_rows):
            print(f"    {line}")
        if status.get("stderr_tail"):
            tail = [t for t in status["stderr_tail"].splitlines() if t.strip()][-3:]
            for line in tail:
                print(f"    stderr: {line[:200]}")


def any_failed(results: str) -> int:
    bad = [r["stage"] for r in read(results) if r.get("case") == "stage_status" and r.get("status") in BAD]
    print(" ".join(bad))
    return 0 if bad else 1


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "record":
        record(*args)
    elif command == "summary":
        summary(*args)
    elif command == "any-failed":
        sys.exit(any_failed(*args))
    else:
        sys.exit(f"gpu_summary.py: unknown command {command!r} (record, summary, any-failed)")
