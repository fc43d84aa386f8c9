"""The short summary at the end of scripts/gpu_check.sh: each stage's status, then the headline
numbers of every JSON it wrote.

    python scripts/gpu_summary.py OUT_DIR STATUS_FILE SECONDS

STATUS_FILE has one line per stage: name, status, seconds, last output line (tab-separated).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def stages(status_file: Path) -> list[str]:
    lines = []
    for row in status_file.read_text().splitlines():
        name, status, seconds, last = (row.split("\t") + ["", "", ""])[:4]
        took = f"{seconds}s" if seconds not in ("", "-") else ""
        lines.append(f"  {name:<8} {status:<28} {took:>5}  {last}")
    return lines


def kernels(report: dict) -> list[str]:
    lines = [f"kernels on {report['device']}: copy bandwidth {report['copy_bandwidth_gb_s']:.0f} GB/s"]
    for kind in ("tree", "prefill"):
        cases = [c for c in report["cases"] if c["kind"] == kind]
        if cases:
            fractions = [c["bandwidth_fraction"] for c in cases]
            vs_sdpa = [c["speedup"]["sdpa_mask"] for c in cases]
            lines.append(f"  {kind:<7} {len(cases)} cases: bandwidth {min(fractions):.0%}-{max(fractions):.0%} "
                         f"(median {statistics.median(fractions):.0%}), vs SDPA+mask "
                         f"{min(vs_sdpa):.2f}x-{max(vs_sdpa):.2f}x")  # fmt: skip
    return lines


def step(report: dict) -> list[str]:
    lines = [f"step cost ({report['batching']}), ms and x the 1-token step, treespec / HF:"]
    for batch in report["config"]["batches"]:
        rows = [r for r in report["forward"] if r["batch"] == batch]
        cells = [f"{r['new_per_request']}: {r['treespec_ms']:.1f}/{r['hf_ms']:.1f} "
                 f"({r['treespec_vs_1']:.2f}/{r['hf_vs_1']:.2f})" for r in rows]  # fmt: skip
        lines.append(f"  B={batch}: " + ", ".join(cells))
    for kind in dict.fromkeys(r["proposer"] for r in report["propose"]):
        rows = [r for r in report["propose"] if r["proposer"] == kind]
        cells = [
            f"B={r['batch']} n={r['budget']}: {r['ms']:.1f}"
            for r in rows
            if r["budget"] in (1, max(report["config"]["budgets"]))
        ]
        lines.append(f"  propose {kind:<6} ms: " + ", ".join(cells))
    return lines


def bench(report: dict) -> list[str]:
    config = report["config"]
    lines = [f"treespec bench, batch {config['batch_size']}, {config['max_new_tokens']} new tokens:"]
    for m in report["methods"]:
        speed = f"{m['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in m else "-"
        tau = f"tau {m['mean_accepted_tokens']:.2f}" if "mean_accepted_tokens" in m else ""
        same = m.get("identical_to_reference")
        same = f"same {same:.2f}" if same is not None else ""
        lines.append(f"  {m['name']:<12} {m['tokens_per_s']:8.1f} tok/s {speed:>7} {tau:>9} {same}")
    return lines


SECTIONS = {"kernels.json": kernels, "bench_step.json": step, "bench_b1.json": bench, "bench_b8.json": bench}


def main(out: str, status_file: str, seconds: str) -> None:
    print(f"=== summary ({seconds}s in all; everything in {out})")
    print("\n".join(stages(Path(status_file))))
    for name, section in SECTIONS.items():
        path = Path(out) / name
        if path.is_file():
            try:
                print("\n".join(section(json.loads(path.read_text()))))
            except (KeyError, ValueError, TypeError) as exc:  # a report of another shape: say so, go on
                print(f"{name}: cannot summarise ({type(exc).__name__}: {exc})")


if __name__ == "__main__":
    main(*sys.argv[1:4])
