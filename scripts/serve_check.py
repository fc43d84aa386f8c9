"""The heads as vLLM serves them, against treespec, on the same prompts (docs/heads.md).

For each head asked for (``--heads KIND=NAME_OR_FOLDER``; KIND is ``eagle``, ``eagle3`` or
``medusa``; default: the shipped EAGLE and Medusa heads of the model, less those vLLM cannot
load, each named with the reason under ``skipped`` in the JSON: conditioned Medusa heads):

1. export it in the published layout (``export_published_eagle`` / ``export_published_medusa``)
   into ``--out``/KIND, the folder vLLM reads;
2. load that folder back into treespec and decode the prompts greedily with a chain of ``--chain``
   drafted tokens (the shape vLLM drafts), recording the tokens committed per step;
3. run vLLM's matching drafter (``method`` = KIND, ``num_speculative_tokens`` = ``--chain``) on the
   same token ids, greedy, the same number of new tokens, and read its tokens per step from its
   counters (1 + accepted / drafts);
4. run each prompt alone in vLLM too, and compare the tokens per step on the prompts the two
   engines decode to the same text (``same_output_ratio``): there only the export can differ.

vLLM runs in its own interpreter (``--vllm-python``, default: the peers' venv that
``../shared/peers/setup.sh`` makes; this script re-enters itself there with ``--vllm-job``, which
imports vLLM alone). Without one, ``--no-vllm`` runs steps 1-2 only, which the tests do.
Prints one line per head and writes JSON (``--json``). Acceptance is not a timing: it may run
beside other work.

    python scripts/serve_check.py [--model smollm2-135m-instruct] [--chain 3] [--new 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

METHODS = ("eagle", "eagle3", "medusa")
PEERS_PYTHON = Path.home() / ".cache" / "treespec-peers" / "vllm" / "bin" / "python"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip


def parse_heads(specs: list[str]) -> dict[str, str]:
    heads = {}
    for spec in specs:
        kind, sep, where = spec.partition("=")
        if not sep or kind not in METHODS or not where:
            raise SystemExit(
                f"--heads takes KIND=NAME_OR_FOLDER with KIND in {', '.join(METHODS)}, got {spec!r}"
            )
        heads[kind] = where
    return heads


def unservable(head) -> str | None:
    """Why vLLM cannot load ``head`` (a loaded treespec head), or None."""
    if getattr(getattr(head, "config", None), "conditioned", False):
        return "conditioned Medusa heads have no published layout vLLM can load (its medusa drafter reads plain heads only)"
    return None


def export(kind: str, where: str, model, folder: Path) -> Path:
    """The head ``where`` (name or folder) written in the published layout vLLM reads."""
    from treespec import heads as heads_module

    head = heads_module.load(where)
    is_eagle3 = getattr(getattr(head, "config", None), "eagle3", None)
    expected = {"eagle": False, "eagle3": True, "medusa": None}[kind]
    if is_eagle3 != expected:
        found = {False: "an EAGLE-1 head", True: "an EAGLE-3 head", None: "Medusa heads"}[is_eagle3]
        raise SystemExit(f"--heads {kind}={where}: that is {found}, not a {kind} head")
    if kind == "medusa":
        if (reason := unservable(head)) is not None:
            raise SystemExit(f"--heads medusa={where}: {reason}; nothing to compare")
        return heads_module.export_published_medusa(head, folder, target=model)
    return heads_module.export_published_eagle(head, folder, target=model)


def treespec_chain(
    kind: str, folder: Path, model, prompts: list[list[int]], chain: int, new: int, eos
) -> dict:
    """Greedy decoding with the exported head, drafting a chain of ``chain`` tokens."""
    import treespec
    from treespec import heads as heads_module
    from treespec.proposers import EagleProposer, MedusaProposer
    from treespec.tree import chain as chain_shape

    head = heads_module.load(folder)
    if kind == "medusa":
        proposer = MedusaProposer(head, model, tree=chain_shape(chain))
    else:
        proposer = EagleProposer(
            head, model, depth=chain, top_k=1, total_tokens=chain, max_batch_size=len(prompts)
        )
    start = time.perf_counter()
    out = treespec.generate(model, prompts, proposer=proposer, max_new_tokens=new, eos_token_id=eos)
    return {"tokens_per_step": out.stats.tau, "steps": out.stats.steps, "seconds": time.perf_counter() - start,
            "sequences": out.sequences, "committed_per_step": out.stats.accepted_lengths}  # fmt: skip


def vllm_chain(python: str, job: dict) -> dict:
    """Run vLLM in ``python`` on ``job`` (this script's --vllm-job mode) and return its report."""
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(job | {"out": str(out_file)}))
        env = os.environ | VLLM_ENV
        run = subprocess.run([python, str(Path(__file__).resolve()), "--vllm-job", str(job_file)], env=env, cwd=tmp,
                             capture_output=True, text=True)  # fmt: skip  # outside the checkout: its folders shadow packages
        if run.returncode != 0 or not out_file.is_file():
            tail = "\n".join(run.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"vLLM ({python}) failed on {job['method']} (exit {run.returncode}):\n{tail}")
        return json.loads(out_file.read_text())


def same_output_ratio(ours: dict, theirs: dict) -> tuple[float | None, int]:
    """vLLM's tokens per step over treespec's on the prompts whose vLLM run alone decoded to
    treespec's text (None: none did), and how many did. There both engines drafted from the same contexts, so only
    the export can make them differ; elsewhere bf16 rounding sends the texts, and what the head is
    asked, apart. treespec's last step per prompt, which drafts fewer tokens, is left out."""
    alone = theirs.get("per_prompt") or []
    same = [i for i, run in enumerate(alone) if run["sequence"] == ours["sequences"][i]]
    drafts = sum(alone[i]["drafts"] for i in same)
    steps = [n for i in same for n in ours["committed_per_step"][i][:-1]]
    if not drafts or not steps:
        return None, len(same)
    vllm = 1 + sum(alone[i]["accepted"] for i in same) / drafts
    return vllm / (sum(steps) / len(steps)), len(same)


def run_vllm_job(job_file: str) -> None:
    """In vLLM's interpreter: greedy decoding with the exported head; counters to JSON."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(job_file).read_text())
    llm = LLM(
        model=job["model"], dtype="bfloat16", max_model_len=job["max_model_len"], enforce_eager=True, seed=0,
        enable_prefix_caching=False, max_num_seqs=len(job["prompts"]), disable_log_stats=False,
        speculative_config={"method": job["method"], "model": job["head"], "num_speculative_tokens": job["chain"]},
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=job["new"], stop_token_ids=job["eos"])

    def counters() -> tuple[float, float, float]:
        values = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        names = ("drafts", "accepted_tokens", "draft_tokens")
        return tuple(values.get(f"vllm:spec_decode_num_{name}") or 0 for name in names)

    start = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params, use_tqdm=False
    )
    seconds = time.perf_counter() - start
    drafts, accepted, draft_tokens = counters()
    per_prompt = []  # each prompt alone, its counters' deltas: the same text gives the same drafts
    for ids in job["prompts"]:
        before = counters()
        (alone,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        after = counters()
        per_prompt.append({"drafts": after[0] - before[0], "accepted": after[1] - before[1],
                           "sequence": list(alone.outputs[0].token_ids)})  # fmt: skip
    report = {"tokens_per_step": 1 + accepted / drafts if drafts else None, "drafts": drafts, "accepted": accepted,
              "draft_tokens": draft_tokens, "seconds": seconds, "per_prompt": per_prompt,
              "sequences": [list(o.outputs[0].token_ids) for o in outs]}  # fmt: skip
    Path(job["out"]).write_text(json.dumps(report))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="registered name or local HF folder (default: treespec's)"
    )
    parser.add_argument(
        "--heads", nargs="*", default=None, help="KIND=NAME_OR_FOLDER (default: the shipped ones)"
    )
    parser.add_argument(
        "--prompts", default=None, help="JSON lines (turns[0], question or prompt); default: built in"
    )
    parser.add_argument("--n", type=int, default=4, help="prompts (evenly spaced in the file)")
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--chain", type=int, default=3, help="drafted tokens per step (a chain)")
    parser.add_argument("--out", default="bench_results/serve_check", help="folder for the exported heads")
    parser.add_argument("--json", default="bench_results/serve_check.json")
    parser.add_argument("--vllm-python", default=str(PEERS_PYTHON), help="an interpreter with vLLM")
    parser.add_argument("--no-vllm", action="store_true", help="export and run treespec only")
    parser.add_argument("--max-gap", type=float, default=None,
                        help="exit 1 when vLLM's tokens per step differ from treespec's by more than this share")  # fmt: skip
    parser.add_argument("--vllm-job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.vllm_job:
        run_vllm_job(args.vllm_job)
        return {}
    if args.chain < 1 or args.new < 2 or args.n < 1:
        raise SystemExit(f"--chain >= 1, --new >= 2 and --n >= 1, got {args.chain}, {args.new}, {args.n}")
    import torch

    from treespec import heads as heads_module
    from treespec import models
    from treespec.prompts import DEFAULT_PROMPTS, encode_prompts, read_prompt_records

    args.model = args.model or models.DEFAULT_MODEL  # resolved here: the vLLM job imports no treespec

    heads = parse_heads(args.heads) if args.heads is not None else {
        kind: name for kind, name in heads_module.shipped_for(args.model).items() if kind in METHODS
    }  # fmt: skip
    skipped = {}  # the shipped heads vLLM cannot load: named, not compared (asked for by --heads: refused)
    if args.heads is None:
        for kind, name in list(heads.items()):
            if (reason := unservable(heads_module.load(name))) is not None:
                skipped[kind] = {"head": name, "reason": reason}
                print(f"{kind:7s} skipped: {reason}")
                del heads[kind]
    if not heads:
        raise SystemExit(f"no heads to check: {args.model} ships none; pass --heads KIND=FOLDER")
    use_vllm = not args.no_vllm
    if use_vllm and not Path(args.vllm_python).is_file():
        raise SystemExit(
            f"no vLLM interpreter at {args.vllm_python}: run ../shared/peers/setup.sh, or pass --no-vllm"
        )
    model_dir = models.pull(args.model) if args.model in models.MODELS else Path(args.model)
    model, tokenizer = models.load(model_dir, dtype=torch.bfloat16)
    texts = [text for _, text in read_prompt_records(args.prompts)] if args.prompts else list(DEFAULT_PROMPTS)
    step = max(1, len(texts) // args.n)
    prompts = encode_prompts(tokenizer, texts[::step][: args.n])
    eos = tokenizer.eos_token_id
    report = {"model": args.model, "chain": args.chain, "new": args.new, "prompts": len(prompts), "heads": {},
              "skipped": skipped}  # fmt: skip
    for kind, where in heads.items():
        folder = export(kind, where, model, Path(args.out) / kind)
        ours = treespec_chain(kind, folder, model, prompts, args.chain, args.new, eos)
        entry = {"head": where, "exported": str(folder), "treespec": ours}
        line = f"{kind:7s} treespec {ours['tokens_per_step']:.3f} tokens/step"
        if use_vllm:
            job = {"model": str(model_dir), "head": str(folder.resolve()), "method": kind, "chain": args.chain,
                   "new": args.new, "prompts": prompts, "eos": [] if eos is None else [eos], "max_model_len": 2048}  # fmt: skip
            theirs = vllm_chain(args.vllm_python, job)
            entry["vllm"] = theirs
            entry["vllm_over_treespec"] = theirs["tokens_per_step"] / ours["tokens_per_step"]
            entry["identical_outputs"] = sum(
                a == b for a, b in zip(ours["sequences"], theirs["sequences"], strict=True)
            )
            entry["same_output_ratio"], entry["identical_alone"] = same_output_ratio(ours, theirs)
            line += (f", vLLM {theirs['tokens_per_step']:.3f} ({entry['vllm_over_treespec']:.3f}x); "
                     f"outputs identical {entry['identical_outputs']}/{len(prompts)}")  # fmt: skip
            if entry["same_output_ratio"] is not None:
                line += (
                    f"; {entry['same_output_ratio']:.3f}x on the {entry['identical_alone']} alike run alone"
                )
        print(line)
        report["heads"][kind] = entry
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    if args.max_gap is not None and use_vllm:
        apart = {
            k: e["vllm_over_treespec"]
            for k, e in report["heads"].items()
            if abs(e["vllm_over_treespec"] - 1) > args.max_gap
        }
        if apart:
            raise SystemExit(f"vLLM's tokens per step differ from treespec's by more than {args.max_gap:.0%}: "
                             + ", ".join(f"{k} {r:.3f}x" for k, r in apart.items()))  # fmt: skip
    return report


if __name__ == "__main__":
    main()
