"""Speculative benchmark: treespec's n-gram proposer (chain and trie) against HF, per category.

Methods, all greedy, batch 1, exactly ``max_new_tokens`` new tokens (EOS ignored), on the same
prompts in one process, interleaved per prompt so that drift hits every method alike:
    hf_generate        HF ``model.generate`` (SDPA)
    hf_prompt_lookup   HF ``model.generate(prompt_lookup_num_tokens=K)`` (HF's n-gram drafting)
    treespec_ar        ``treespec.generate`` without a proposer
    ngram_chain        treespec + NgramProposer(tree=False): one match, a chain of K
    ngram_trie         treespec + NgramProposer(tree=True): up to 8 matches merged in a trie
Prompts come from a JSONL file with ``category`` and ``turns`` fields (Spec-Bench's layout),
wrapped in the model's chat template. Reported per category and overall: tokens/s (total new
tokens over total time), tau, and the per-stage times of the treespec methods.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import treespec
from treespec.bench import DTYPES
from treespec.models import load
from treespec.prompts import encode_prompts
from treespec.proposers import NgramProposer
from treespec.target import Target


@dataclass(frozen=True)
class SpecBenchConfig:
    prompts: str  # JSONL with "category" and "turns"
    model: str = "smollm2-135m-instruct"
    dtype: str = "bf16"
    per_category: int = 2
    max_new_tokens: int = 128
    draft_tokens: int = 8  # K: HF's prompt_lookup_num_tokens and the n-gram depth
    max_prompt_tokens: int = 1024  # longer prompts are skipped (CPU time)
    token_cost: float = 0.3  # NgramProposer's adaptive depth; measured for SmolLM2 on a 2-core CPU

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("per_category", "max_new_tokens", "draft_tokens", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def read_prompts(path: str, per_category: int) -> list[tuple[str, str]]:
    """(category, text) pairs: the first ``per_category`` prompts of each category, in file order."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    picked: dict[str, list[str]] = defaultdict(list)
    for line in file.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "category" not in row or "turns" not in row:
            raise ValueError(f"{path}: every line needs 'category' and 'turns', got keys {sorted(row)}")
        if len(picked[row["category"]]) < per_category:
            picked[row["category"]].append(row["turns"][0])
    return [(category, text) for category, texts in picked.items() for text in texts]


def run_spec(
    config: SpecBenchConfig, out_path: str | Path | None = None, log: Callable[[str], None] = print
) -> dict:
    hf_model, tokenizer = load(config.model, dtype=DTYPES[config.dtype])
    ts_model, _ = load(config.model, dtype=DTYPES[config.dtype])  # the baselines keep stock SDPA
    target = Target(ts_model)
    new, k = config.max_new_tokens, config.draft_tokens
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def hf(ids: list[int], **extra) -> dict:
        out = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,  # never stop, and (unlike min_new_tokens) never suppress EOS either
            **extra,
        )
        return {"tokens": out[0, len(ids) :].tolist()}

    def ours(ids: list[int], proposer) -> dict:
        out = treespec.generate(target, [ids], max_new_tokens=new, eos_token_id=[], proposer=proposer)
        s = out.stats
        return {"tokens": out.sequences[0], "tau": s.tau, "steps": s.steps,
                "stages_s": {"propose": s.propose_s, "score": s.forward_s, "verify": s.verify_s, "commit": s.commit_s}}  # fmt: skip

    methods = {
        "hf_generate": lambda ids: hf(ids),
        "hf_prompt_lookup": lambda ids: hf(ids, prompt_lookup_num_tokens=k),
        "treespec_ar": lambda ids: ours(ids, None),
        "ngram_chain": lambda ids: ours(
            ids, NgramProposer(max_depth=k, tree=False, token_cost=config.token_cost)
        ),
        "ngram_trie": lambda ids: ours(
            ids, NgramProposer(max_depth=k, max_nodes=4 * k, token_cost=config.token_cost)
        ),
    }
    prompts = [(c, ids) for (c, text) in read_prompts(config.prompts, config.per_category)
               for ids in encode_prompts(tokenizer, [text]) if len(ids) <= config.max_prompt_tokens]  # fmt: skip
    for fn in methods.values():  # warm-up on the first prompt
        fn(prompts[0][1][:64])
    rows = []
    rss_before = _rss_mib()
    for category, ids in prompts:
        row = {"category": category, "prompt_tokens": len(ids), "methods": {}}
        for name, fn in methods.items():
            start = time.perf_counter()
            result = fn(ids)
            result["seconds"] = time.perf_counter() - start
            row["methods"][name] = result
        reference = row["methods"]["hf_generate"]["tokens"]
        for result in row["methods"].values():
            result["same_tokens_as_hf_generate"] = result.pop("tokens") == reference
        rows.append(row)
        log(f"{category:>15} ({len(ids)} prompt tokens): " + "  ".join(
            f"{n} {new / r['seconds']:5.1f}" for n, r in row["methods"].items()))  # fmt: skip
    summary = _summarise(rows, new)
    for category, per_method in summary.items():
        log(f"{category:>15}: " + "  ".join(f"{m} {v['tokens_per_s']:5.1f} tok/s" + (f" (tau {v['tau']:.2f})" if "tau" in v else "")
                                            for m, v in per_method.items()))  # fmt: skip
    rss = {"before_mib": rss_before, "after_mib": _rss_mib()}
    log(f"process RSS before the runs {rss['before_mib']:.0f} MiB, after {rss['after_mib']:.0f} MiB")
    report = {"config": asdict(config), "summary": summary, "rss": rss, "prompts": rows}
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(report, indent=2))
        log(f"wrote {out_path}")
    return report


def _summarise(rows: list[dict], new: int) -> dict:
    """Per category and overall: tokens/s = all new tokens / all seconds; mean tau; ratios."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["category"]].append(row)
        groups["all"].append(row)
    summary = {}
    for category, members in groups.items():
        per_method = {}
        for name in members[0]["methods"]:
            results = [m["methods"][name] for m in members]
            entry = {"tokens_per_s": new * len(results) / sum(r["seconds"] for r in results)}
            if "tau" in results[0]:
                entry["tau"] = statistics.mean(r["tau"] for r in results)
            entry["same_tokens_as_hf_generate"] = sum(r["same_tokens_as_hf_generate"] for r in results) / len(
                results
            )
            per_method[name] = entry
        for entry in per_method.values():
            entry["vs_hf_generate"] = entry["tokens_per_s"] / per_method["hf_generate"]["tokens_per_s"]
            entry["vs_hf_prompt_lookup"] = (
                entry["tokens_per_s"] / per_method["hf_prompt_lookup"]["tokens_per_s"]
            )
        summary[category] = per_method
    return summary


def _rss_mib() -> float:
    """Resident set size of this process (Linux /proc; NaN elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")
