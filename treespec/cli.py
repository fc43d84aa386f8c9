"""The ``treespec`` command line.

Each top-level command is added by one ``_add_<command>_parser(subparsers)`` function that sets
``handler`` on its leaf parsers; ``main`` parses and calls ``args.handler(args)``. A new command
(``bench``, ``train-heads``, ...) only needs its own ``_add_..._parser`` call in ``build_parser``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from treespec import models

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
    print(models.pull(args.name, force=args.force, progress=not args.quiet))
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


def _add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmark treespec against HF generate and a bare HF loop, side by side",
        description="All methods run on the same prompts in one process; medians of interleaved repeats.",
    )
    bench.add_argument("--model", default="smollm2-135m-instruct", help="registered name or local HF folder")
    bench.add_argument(
        "--dtypes", type=_csv(str), default=("bf16", "fp32"), help="comma list of bf16, fp16, fp32"
    )
    bench.add_argument("--batch-sizes", type=_csv(int), default=(1, 4), help="comma list, e.g. 1,4")
    bench.add_argument("--max-new-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=3, help="timed runs per method (median reported)")
    bench.add_argument("--warmup", type=int, default=1)
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    bench.add_argument("--out", default=None, help="JSON report path (default bench_results/<mode>.json)")
    bench.add_argument(
        "--proposer", choices=["none", "ngram"], default="none",
        help="none: autoregressive treespec vs HF; ngram: n-gram chain/trie vs HF generate and HF prompt lookup",
    )  # fmt: skip
    bench.add_argument(
        "--prompts", help="with --proposer ngram: JSONL with 'category' and 'turns' (Spec-Bench)"
    )
    bench.add_argument(
        "--per-category", type=int, default=2, help="with --proposer ngram: prompts per category"
    )
    bench.add_argument("--draft-tokens", type=int, default=8, help="with --proposer ngram: draft depth K")
    bench.add_argument(
        "--token-cost", type=float, default=0.3,
        help="with --proposer ngram: NgramProposer's relative cost of one more verified token (0 = fixed depth)",
    )  # fmt: skip
    bench.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    if args.proposer == "ngram":
        from treespec.bench_spec import SpecBenchConfig, run_spec

        if not args.prompts:
            raise ValueError("--proposer ngram needs --prompts FILE.jsonl (Spec-Bench layout)")
        dtype = args.dtypes[0] if args.dtypes else "bf16"
        spec = SpecBenchConfig(
            prompts=args.prompts, model=args.model, dtype=dtype, per_category=args.per_category,
            max_new_tokens=args.max_new_tokens, draft_tokens=args.draft_tokens, token_cost=args.token_cost,
        )  # fmt: skip
        run_spec(spec, out_path=args.out or "bench_results/ngram.json")
        return EXIT_OK
    from treespec.bench import BenchConfig, run

    config = BenchConfig(
        model=args.model,
        dtypes=args.dtypes,
        batch_sizes=args.batch_sizes,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        threads=args.threads,
    )
    run(config, out_path=args.out or "bench_results/bench.json")
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
