"""A head's learning curve: train it on nested subsets of one data folder, measure each with
``treespec bench`` (batch 1, a fixed tree of 31 drafted nodes at T=0, and each further
``--settings`` entry: nodes:temperature) on held-out prompts. ``--kind draft --draft-layers N``
trains a draft model of the target's first N layers (the head-size axis).

    python scripts/learning_curve.py --data runs/data --points 50000,200000,1000000 \\
        --prompts ../shared/data/prompts/spec_bench/question_no_mtbench.jsonl --per-category 4

Each point trains on whole sequences until that many answer tokens, in an order fixed by their
tokens (``train-heads train --data-tokens``), so a point's data holds the smaller points' data.
A point the data cannot fill yet is skipped and said so; run the script again once the data has
grown: finished points are kept (their run folders hold the head and the bench JSON; they were
drawn from the data as it was then, the same prompt distribution) and an interrupted training
resumes from its last checkpoint (every ``--checkpoint-every`` steps); a point's training wall time
counts every run it took.

Writes OUT/curve.json, OUT/curve.md (the table for docs/training.md) and OUT/curve.png, which
also draws the curves of the ``--beside`` folders (another kind's curve.json) for comparison.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from treespec import models
from treespec.bench.e2e import BenchConfig, run
from treespec.heads.training.data import HeadDataset
from treespec.heads.training.train import (
    CHECKPOINT,
    TrainConfig,
    acceptance_by_depth,
    expand_histogram,
    train,
)
from treespec.models import DEFAULT_MODEL


def setting(text: str) -> tuple[int, float]:
    """ "nodes:temperature" -> (nodes, temperature)."""
    try:
        nodes, temperature = text.split(":")
        nodes, temperature = int(nodes), float(temperature)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected nodes:temperature such as 8:0 or 31:1, got {text!r}"
        ) from None
    if not 1 <= nodes <= 31 or temperature < 0:
        raise argparse.ArgumentTypeError(f"nodes must be 1..31 and temperature >= 0, got {text!r}")
    return nodes, temperature


def measure(
    head: Path, args: argparse.Namespace, json_path: Path, nodes: int = 31, temperature: float = 0.0
) -> dict:
    config = BenchConfig(model=args.model, proposers=(args.kind_method,), baselines=(), prompts=args.prompts,
                         per_category=args.per_category, max_new_tokens=args.new_tokens, budget="fixed" if nodes == 31 else str(nodes),
                         temperature=temperature, heads=((args.kind_method, str(head)),), warmup=0,
                         json=str(json_path))  # fmt: skip
    report = run(config, log=lambda line: None)
    method = next(m for m in report["methods"] if m["name"] == args.kind_method)
    lengths = expand_histogram(method["accepted_length_histogram"])
    return {
        "tau": method["mean_accepted_tokens"],
        "tau_per_category": {c: v["tau"] for c, v in method["per_category"].items()},
        "acceptance_by_depth": acceptance_by_depth(lengths),
        "identical_to_reference": method["identical_to_reference"],
        "prompts": sum(int(size) * count for size, count in report["batch_sizes_run"].items()),
    }


def setting_name(nodes: int, temperature: float) -> str:
    return f"{nodes} nodes T={temperature:g}"


def table(points: list[dict]) -> str:
    done = [p for p in points if "tau" in p]
    if not done:
        return "(no point measured yet)\n"
    categories = list(done[0]["tau_per_category"])
    others = list(done[0].get("tau_at", {}))
    lines = [
        "| answer tokens | positions | training wall time | final loss | tau | "
        + " | ".join(categories + [f"tau, {o}" for o in others])
        + " | acceptance by depth (1..5) |",
        "|---" * (6 + len(categories) + len(others)) + "|",
    ]
    for p in done:
        depth = ", ".join(f"{a:.2f}" for a in p["acceptance_by_depth"][:5])
        cells = [f"{p['tau_per_category'][c]:.2f}" for c in categories]
        cells += [f"{p['tau_at'][o]:.2f}" for o in others]
        lines.append(
            f"| {p['answer_tokens']:,} | {p['positions']:,} | {p['wall_s'] / 60:.1f} min | {p['loss']:.3f} | "
            f"**{p['tau']:.2f}** | " + " | ".join(cells) + f" | {depth} |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: Path, kind: str, beside: dict[str, list[dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [p for p in points if "tau" in p]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["answer_tokens"] for p in done], [p["tau"] for p in done], "o-", label=f"{kind}, 31 nodes T=0")
    for other, rows in beside.items():
        rows = [p for p in rows if "tau" in p]
        ax.plot(
            [p["answer_tokens"] for p in rows],
            [p["tau"] for p in rows],
            "s--",
            label=f"{other}, 31 nodes T=0",
        )
    for name in done[0].get("tau_at", {}) if done else []:
        ax.plot(
            [p["answer_tokens"] for p in done],
            [p["tau_at"][name] for p in done],
            "o:",
            label=f"{kind}, {name}",
        )
        for other, rows in beside.items():
            rows = [p for p in rows if name in p.get("tau_at", {})]
            ax.plot([p["answer_tokens"] for p in rows], [p["tau_at"][name] for p in rows], "s:", alpha=0.7,
                    label=f"{other}, {name}")  # fmt: skip
    if not beside:
        for category in done[0]["tau_per_category"] if done else []:
            ax.plot([p["answer_tokens"] for p in done], [p["tau_per_category"][category] for p in done], ".:",
                    alpha=0.6, label=category)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("answer tokens trained on")
    ax.set_ylabel("tau (tokens per target step)")
    ax.set_title(f"learning curve{'s' if beside else ''}: {', '.join([kind, *beside])}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--data", required=True, type=Path, help="folder written by 'treespec train-heads features'"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/curve"))
    parser.add_argument("--kind", default="eagle", choices=["eagle", "eagle3", "medusa", "draft"])
    parser.add_argument("--points", default="50000,200000,1000000", help="answer tokens per point")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--draft-layers", type=int, default=TrainConfig.draft_layers,
                        help="draft model: the target's first N layers (the head-size axis)")  # fmt: skip
    parser.add_argument("--prompts", default=None, help="bench prompts (default: treespec's own)")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--settings", type=setting, nargs="*", default=[],
                        help="further measurements beside 31 nodes at T=0, as nodes:temperature (e.g. 8:0 31:1)")  # fmt: skip
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="training precision")
    parser.add_argument("--beside", type=Path, nargs="*", default=[],
                        help="curve folders of other kinds to draw beside this one")  # fmt: skip
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        help="steps between checkpoints, so a killed point resumes near where it stopped",
    )
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    args.kind_method = "eagle" if args.kind.startswith("eagle") else args.kind
    if args.threads:
        torch.set_num_threads(args.threads)
    points = sorted(int(p) for p in args.points.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    model, _ = models.load(args.model, dtype=torch.float32)
    data = HeadDataset(args.data, model)
    # the dev answers 'features' wrote beside the data (never trained on): each epoch's dev loss
    dev = HeadDataset(args.data / "dev", model) if (args.data / "dev" / "manifest.json").is_file() else None
    available = sum(len(s.tokens) - s.prompt_len for s in data)
    results = []
    for point in points:
        folder = args.out / f"{args.kind}-{point}"
        if point > available:
            print(f"{point:,} answer tokens: skipped, the data holds {available:,} so far")
            results.append({"answer_tokens": point, "skipped": f"the data held {available:,} answer tokens"})
            continue
        if not (folder / "report.json").is_file():
            config = TrainConfig(kind=args.kind, epochs=args.epochs, lr=args.lr, ttt_steps=args.ttt_steps,
                                 data_tokens=point, eval_prompts=0, checkpoint_every=args.checkpoint_every,
                                 precision=args.precision, draft_layers=args.draft_layers)  # fmt: skip
            train(config, model, data, folder, resume=(folder / CHECKPOINT).is_file(), dev=dev)
        report = json.loads((folder / "report.json").read_text())
        if not (folder / "measured.json").is_file():  # written last: a kill before it measures again
            measured = measure(folder / "head", args, folder / "bench.json")
            (folder / "measured.json").write_text(json.dumps(measured, indent=1))
        measured = json.loads((folder / "measured.json").read_text())
        for nodes, temperature in args.settings:  # each kept in its own file, measured once
            name = setting_name(nodes, temperature)
            path = folder / f"measured-{nodes}-{temperature:g}.json"
            if not path.is_file():
                bench_json = folder / f"bench-{nodes}-{temperature:g}.json"
                path.write_text(
                    json.dumps(measure(folder / "head", args, bench_json, nodes, temperature), indent=1)
                )
            measured.setdefault("tau_at", {})[name] = json.loads(path.read_text())["tau"]
        result = {"answer_tokens": report["answer_tokens"], "positions": report["data_tokens"],
                  "wall_s": report["wall_s"], "loss": report["history"][-1]["mean_loss"],
                  "dev_loss": [h.get("dev_loss") for h in report["history"]],
                  "steps": report["steps"], **measured}  # fmt: skip
        print(json.dumps(result))
        results.append(result)
    (args.out / "curve.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                     "points": results}, indent=1))  # fmt: skip
    (args.out / "curve.md").write_text(table(results))
    if any("tau" in p for p in results):
        beside = {}
        for folder in args.beside:
            other = json.loads((folder / "curve.json").read_text())
            beside[other["args"].get("kind", folder.name)] = other["points"]
        plot(results, args.out / "curve.png", args.kind, beside)
    print(table(results))


if __name__ == "__main__":
    main()
