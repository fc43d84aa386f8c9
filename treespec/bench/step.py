"""What one speculative step costs: the target's forward for n new tokens, HF's own forward over
the same tokens, and each proposer's drafting time per tree size.

    treespec bench step [--device cuda] [--dtype bf16] [--model smollm2-135m-instruct]
                                 [--out bench_results/bench_step.json] [--quick]

Batching: size n means n new tokens for *each* of the B requests (B * n rows in one forward), on
top of ``--context`` (300) cached tokens per request. Three measurements, each a median over
``--repeats`` timed runs after ``--warmup`` untimed ones (on CUDA the device is synchronised
before every clock read):

    treespec   ``Target.forward`` over B causal chains of n tokens (the engine's scoring call;
               the K/V are written past the committed prefix and never committed, so every run
               sees the same cache)
    hf         the plain HF model called with its own cache (a ``DynamicCache`` holding the
               context, passed as ``past_key_values``) on a [B, n] batch; each run gets a fresh copy of the prefilled cache, made
               outside the timed region, so the cache never grows across runs
    propose    each proposer (``ngram`` and the heads shipped for the model: ``draft``, ``medusa``,
               ``eagle``, with the settings of ``treespec bench``) drafting a fixed budget of n
               nodes per request, timed per call inside a running ``treespec.Engine`` (the
               proposer's catch-up on the tokens committed since its last call included, as in a
               real step); the tree size it actually returned is recorded beside the budget

Ratios are against the 1-token (or 1-node) time of the same batch in the same process. The JSON
(``--out``) holds every row; a PNG of the curves is written next to it when matplotlib is
installed (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from treespec import heads as head_registry
from treespec.bench.timing import median_seconds
from treespec.engine import Engine
from treespec.heads.draft import readout_ids
from treespec.models import DEFAULT_MODEL, DTYPES, load
from treespec.presets import DRAFT_TREE, DRAFT_VOCAB, EAGLE_TREE, MEDUSA_TREE
from treespec.prompts import BENCH_PROMPTS, encode_prompts
from treespec.proposers import DraftModelProposer, EagleProposer, MedusaProposer, NgramProposer
from treespec.proposers.base import Proposer, WrappingProposer
from treespec.target import Target
from treespec.target.linear import LINEAR_BACKENDS

PROPOSERS = ("ngram", "draft", "medusa", "eagle")
BATCHING = "per request: n new tokens (or drafted nodes) for each of the B requests, B * n in the step"


@dataclass(frozen=True)
class StepBenchConfig:
    device: str = "cpu"
    dtype: str = "bf16"
    context: int = 300  # cached tokens per request
    batches: tuple[int, ...] = (1, 4, 8)
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # new tokens per request
    budgets: tuple[int, ...] = (1, 2, 4, 8, 16, 31)  # drafted nodes per request (31: the proposers' own)
    proposers: tuple[str, ...] = PROPOSERS
    repeats: int = 10
    warmup: int = 3
    attention_backend: str = "auto"  # the target's (and the draft model's): auto = Triton on CUDA
    linear_backends: tuple[str, ...] = ("auto",)  # one target per backend, measured side by side
    draft_vocab: bool = True  # heads read out as treespec bench's default (--draft-vocab 8192)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not self.linear_backends or any(b not in LINEAR_BACKENDS for b in self.linear_backends):
            raise ValueError(f"linear_backends must be from {LINEAR_BACKENDS}, got {self.linear_backends}")
        unknown = [p for p in self.proposers if p not in PROPOSERS]
        if unknown:
            raise ValueError(f"unknown proposer(s) {unknown}: choose from {', '.join(PROPOSERS)}")
        if 1 not in self.sizes or 1 not in self.budgets:
            raise ValueError("sizes and budgets must include 1: ratios are taken against it")
        if min(self.context, self.repeats, *self.batches, *self.sizes, *self.budgets) < 1 or self.warmup < 0:
            raise ValueError("context, repeats, batches, sizes and budgets must be >= 1, warmup >= 0")


# A small configuration for tests and smoke runs.
QUICK = dict(context=64, batches=(1, 2), sizes=(1, 4, 16), budgets=(1, 4), repeats=2, warmup=1)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(run: Callable, config: StepBenchConfig, setup: Callable | None = None) -> float:
    """Median milliseconds of ``run(setup())`` over ``config.repeats`` calls after
    ``config.warmup``; ``setup`` (untimed) gives each call a fresh input."""
    return 1e3 * median_seconds(run, config.repeats, warmup=config.warmup, setup=setup or (lambda: None),
                                device=config.device)  # fmt: skip


def random_tokens(
    shape: tuple[int, ...], vocab: int, generator: torch.Generator, device: str
) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=generator).to(device)


# --------------------------------------------------------------------------------------------
# Forward cost: treespec's Target and the plain HF model
# --------------------------------------------------------------------------------------------


def target_forward_ms(target: Target, batch: int, config: StepBenchConfig) -> dict[int, float]:
    """Size -> ms of ``Target.forward`` over ``batch`` chains of that many new tokens each."""
    generator = torch.Generator().manual_seed(config.seed)
    context, vocab = config.context, target.vocab_size
    cache = target.new_cache(batch, context + max(config.sizes))
    slots = [cache.allocate() for _ in range(batch)]  # host lists, as the engine's step passes them
    prompt = random_tokens((batch * context,), vocab, generator, config.device)  # [B * C]
    target.forward(prompt, cache, [b * context for b in range(batch + 1)], slots, return_hidden=False)
    for slot in slots:  # a prefill chain commits all its tokens
        cache.lengths[slot] = context
    times = {}
    for n in config.sizes:
        tokens = random_tokens((batch * n,), vocab, generator, config.device)  # [B * n]
        cu_q = [b * n for b in range(batch + 1)]  # [B + 1]: request b owns rows b*n .. (b+1)*n - 1

        def run(_, tokens=tokens, cu_q=cu_q):
            target.forward(tokens, cache, cu_q, slots, return_hidden=False)

        times[n] = median_ms(run, config)
    return times


@torch.inference_mode()
def hf_forward_ms(model, batch: int, config: StepBenchConfig) -> dict[int, float]:
    """Size -> ms of the plain HF model over [batch, n] new tokens on a cached context."""
    generator = torch.Generator().manual_seed(config.seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    context = random_tokens((batch, config.context), vocab, generator, config.device)  # [B, C]
    # HF's own cache (a DynamicCache), named `cache` by recent transformers, `past_key_values` before
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=context, use_cache=True, logits_to_keep=1)
    prefilled = out[name] if name in out else out["past_key_values"]
    times = {}
    for n in config.sizes:
        tokens = random_tokens((batch, n), vocab, generator, config.device)  # [B, n]

        def run(cache, tokens=tokens):
            model(input_ids=tokens, use_cache=True, **{name: cache})

        times[n] = median_ms(run, config, setup=lambda: copy.deepcopy(prefilled))
    return times


# --------------------------------------------------------------------------------------------
# Drafting cost
# --------------------------------------------------------------------------------------------


class TimedProposer(WrappingProposer):
    """Wraps a proposer, timing each ``propose`` call and counting the nodes it drafted; its
    capabilities and every other call are the wrapped proposer's."""

    def __init__(self, inner: Proposer, device: str) -> None:
        super().__init__(inner)
        self.device = device
        self.seconds: list[float] = []  # per call
        self.drafted: list[float] = []  # per call: drafted nodes per request, the roots not counted

    def propose(self, requests):
        synchronize(self.device)
        start = time.perf_counter()
        tree = self.proposer.propose(requests)
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - start)
        self.drafted.append((tree.tokens.numel() - len(requests)) / len(requests))
        return tree


def make_proposer(kind: str, model, head, batch: int, budget: int, config: StepBenchConfig):
    """A fresh proposer drafting ``budget`` nodes per request, with ``treespec bench``'s settings
    (31 nodes at most; the heads' depth limits as there)."""
    if kind == "ngram":  # no settable budget: one proposer per size, as deep as the nodes allow
        return NgramProposer(max_depth=min(budget, 8), max_nodes=budget)
    linear = config.linear_backends[0]
    vocab = model.get_output_embeddings().weight.shape[0]
    # treespec bench's default read-out: the first 8,192 ids, for heads without their own
    readout = range(min(DRAFT_VOCAB, vocab)) if config.draft_vocab else None
    if kind == "eagle":
        own = head.config.eagle3 or head.config.draft_vocab_size is not None
        proposer = EagleProposer(head, model, **EAGLE_TREE, max_batch_size=batch,
                                 attention_backend=config.attention_backend, linear_backend=linear,
                                 readout_ids=None if own else readout)  # fmt: skip
    elif kind == "medusa":
        proposer = MedusaProposer(head, model, **MEDUSA_TREE, linear_backend=linear,
                                  readout_ids=None if head.config.own_lm_head else readout)  # fmt: skip
    else:  # draft
        proposer = DraftModelProposer(head, target_model=model, **DRAFT_TREE, max_batch_size=batch,
                                      attention_backend=config.attention_backend,
                                      readout_ids=None if readout_ids(head) is not None else readout)  # fmt: skip
    proposer.set_budget(budget, budget)  # as deep as the nodes allow, within the proposer's depth
    return proposer


def drafting_ms(target, proposer, prompts: list[list[int]], config: StepBenchConfig) -> tuple[float, float]:
    """(median ms per ``propose`` call, mean drafted nodes per request) while ``target`` decodes
    ``prompts`` as one batch with this proposer."""
    timed = TimedProposer(proposer, config.device)
    calls = config.warmup + config.repeats
    max_new = 10 * calls + 8  # never reached: no request finishes (and is released) while timed
    engine = Engine(target, max_batch_size=len(prompts), max_len=config.context + max_new,
                             proposer=timed)  # fmt: skip
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens=max_new, eos_token_id=[])
    while len(timed.seconds) < calls:
        engine.step()
    kept = slice(config.warmup, calls)
    return 1e3 * statistics.median(timed.seconds[kept]), statistics.fmean(timed.drafted[kept])


def fit_prompt(prompt: list[int], length: int) -> list[int]:
    """``prompt`` repeated and cut to ``length`` tokens (repetition gives n-grams to copy)."""
    return (prompt * (length // len(prompt) + 1))[:length]


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def label(target: Target) -> str:
    """linear + attention backend, the pair that names a measured target."""
    return f"{target.linear_backend}+{target.attention_backend}"


def relative(times: dict[int, float]) -> dict[int, float]:
    return {n: t / times[1] for n, t in times.items()}


def _forward_rows(
    model, targets: list[Target], batch: int, config: StepBenchConfig, log
) -> tuple[list[dict], float]:
    """The target's forward per size on each backend beside HF's; the first backend's one-token
    step (what drafting is set against)."""
    hf = hf_forward_ms(model, batch, config)
    rows, measured = [], []
    for each in targets:
        ours = target_forward_ms(each, batch, config)
        measured.append(ours)
        for n in config.sizes:
            rows.append({"batch": batch, "linear_backend": each.linear_backend,
                         "attention_backend": each.attention_backend, "new_per_request": n,
                         "new_tokens": batch * n, "treespec_ms": ours[n], "treespec_vs_1": relative(ours)[n],
                         "hf_ms": hf[n], "hf_vs_1": relative(hf)[n]})  # fmt: skip
            log(f"forward B={batch:<2} n={n:<3} {label(each):<22} treespec {ours[n]:8.2f} ms "
                f"({relative(ours)[n]:5.2f}x)  hf {hf[n]:8.2f} ms ({relative(hf)[n]:5.2f}x)")  # fmt: skip
    return rows, measured[0][1]


def _propose_rows(kind: str, model, head, target: Target, batch: int, prompts, single_ms: float,
                  config: StepBenchConfig, log) -> list[dict]:  # fmt: skip
    """One proposer's drafting time per budget, against its budget-1 time and one target step."""
    rows, times = [], {}
    for budget in config.budgets:
        proposer = make_proposer(kind, model, head, batch, budget, config)
        times[budget], drafted = drafting_ms(target, proposer, prompts, config)
        rows.append({"proposer": kind, "batch": batch, "budget": budget, "drafted_nodes": drafted,
                     "ms": times[budget], "vs_1": times[budget] / times[1],
                     "vs_target_step": times[budget] / single_ms})  # fmt: skip
        log(f"propose {kind:<6} B={batch:<2} budget {budget:<3} drafted {drafted:5.1f}  "
            f"{times[budget]:8.2f} ms ({times[budget] / times[1]:5.2f}x)")  # fmt: skip
    return rows


def run(model, heads: dict, prompts: list[list[int]], config: StepBenchConfig, log=print) -> dict:
    """Every measurement for ``model`` (on ``config.device`` in ``config.dtype`` already).

    ``heads``: kind -> loaded head module (``draft``, ``medusa``, ``eagle``); a proposer whose
    head is missing is skipped and listed in ``skipped``. ``prompts``: token lists the proposer
    runs decode (cycled over the batch, fitted to ``config.context`` tokens)."""
    torch.manual_seed(config.seed)
    targets = [Target(model, attention_backend=config.attention_backend, linear_backend=name)
               for name in config.linear_backends]  # fmt: skip
    target = targets[0]  # the proposers draft inside an engine on the first
    forward, propose, skipped = [], [], {}
    for batch in config.batches:
        rows, single_ms = _forward_rows(model, targets, batch, config, log)
        forward += rows
        batch_prompts = [fit_prompt(prompts[b % len(prompts)], config.context) for b in range(batch)]
        for kind in config.proposers:
            if kind != "ngram" and kind not in heads:
                skipped[kind] = "no head of this kind for the model"
                continue
            propose += _propose_rows(
                kind, model, heads.get(kind), target, batch, batch_prompts, single_ms, config, log
            )
    return {
        "config": asdict(config),
        "batching": BATCHING,
        "target": {
            "attention_backend": target.attention_backend,
            "linear_backends": [each.linear_backend for each in targets],
            "backends": [label(each) for each in targets],
        },
        "machine": machine(config.device),
        "forward": forward,
        "propose": propose,
        "skipped": skipped,
    }


def machine(device: str) -> dict:
    info = {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def plot(report: dict, path: Path) -> bool:
    """Forward ms per new tokens (treespec solid, HF dashed) and drafting ms per budget."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    _plot_forward(left, report)
    _plot_propose(right, report)
    ticks = (report["config"]["sizes"], report["config"]["budgets"])
    for axis, xs in zip((left, right), ticks, strict=True):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.legend(fontsize=7)
    device = report["machine"].get("gpu", report["config"]["device"])
    fig.suptitle(f"{report.get('model', 'model')} {report['config']['dtype']} on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_forward(axis, report: dict) -> None:
    """ms per forward against new tokens per request: treespec solid, HF dashed, a colour per batch."""
    backends = report["target"]["backends"]
    for batch in report["config"]["batches"]:
        for backend in backends:
            rows = [r for r in report["forward"]
                    if r["batch"] == batch and f"{r['linear_backend']}+{r['attention_backend']}" == backend]  # fmt: skip
            xs = [r["new_per_request"] for r in rows]
            name = f"treespec {backend}" if len(backends) > 1 else "treespec"
            (line,) = axis.plot(xs, [r["treespec_ms"] for r in rows], marker="o", label=f"{name} B={batch}")
        axis.plot(
            xs, [r["hf_ms"] for r in rows], "--", marker="x", color=line.get_color(), label=f"HF B={batch}"
        )
    axis.set(xlabel="new tokens per request", ylabel="ms per forward")
    axis.set_title(f"forward, {report['config']['context']}-token context")


def _plot_propose(axis, report: dict) -> None:
    """ms per propose call against the drafting budget, a line per proposer and batch."""
    for kind in dict.fromkeys(r["proposer"] for r in report["propose"]):
        for batch in report["config"]["batches"]:
            rows = [r for r in report["propose"] if r["proposer"] == kind and r["batch"] == batch]
            axis.plot(
                [r["budget"] for r in rows], [r["ms"] for r in rows], marker="o", label=f"{kind} B={batch}"
            )
    axis.set(xlabel="drafted nodes per request (budget)", ylabel="ms per propose call")
    axis.set_title("drafting")


def write(report: dict, out: Path, log=print) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    log(f"wrote {out}")
    png = out.with_suffix(".png")
    if plot(report, png):
        log(f"wrote {png}")
    else:
        log("no plot: matplotlib is not installed (pip install 'treespec[plot]')")


def _csv(text: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in text.split(",") if part)


def _arguments(argv: list[str] | None, prog: str | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registered name or local HF folder")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--out", type=Path, default=Path("bench_results/bench_step.json"))
    parser.add_argument("--quick", action="store_true", help="a small configuration: " + str(QUICK))
    parser.add_argument("--context", type=int, help="cached tokens per request (default 300)")
    parser.add_argument("--batches", type=_csv, help="comma list (default 1,4,8)")
    parser.add_argument("--sizes", type=_csv, help="new tokens per request, comma list (default 1,...,64)")
    parser.add_argument(
        "--budgets", type=_csv, help="drafted nodes per request, comma list (default 1,...,31)"
    )
    parser.add_argument("--proposers", type=_csv, help=f"comma list of {', '.join(PROPOSERS)} (default all)")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--attention-backend", choices=["auto", "triton", "reference"])
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--linear-backends", type=_csv,
                        help="comma list of treespec linear backends measured side by side (default auto); "
                             "the proposers draft with the first")  # fmt: skip
    parser.add_argument("--heads", action="append", default=[], metavar="KIND=PATH",
                        help="use this head folder for eagle, medusa or draft instead of the shipped one; repeatable")  # fmt: skip
    parser.add_argument("--full-readout", action="store_true",
                        help="EAGLE-1 heads, Medusa heads and the draft model read out through the whole vocabulary (default: the first "
                        f"{DRAFT_VOCAB} ids, as treespec bench)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    args = _arguments(argv, prog)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = ("context", "batches", "sizes", "budgets", "proposers", "repeats", "warmup", "attention_backend",
             "linear_backends")  # fmt: skip
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    overrides = {**(QUICK if args.quick else {}), **given}
    config = replace(StepBenchConfig(device=args.device, dtype=args.dtype, draft_vocab=not args.full_readout),
                     **overrides)  # fmt: skip
    given_heads = dict(head_registry.head_override(text) for text in args.heads)
    model, tokenizer = load(args.model, dtype=DTYPES[config.dtype], device=config.device)
    chosen = {**head_registry.shipped_for(args.model), **given_heads}
    heads = {kind: head_registry.load(name, dtype=model.dtype, device=config.device, target_model=model)
             for kind, name in chosen.items() if kind in config.proposers}  # fmt: skip
    prompts = encode_prompts(tokenizer, [text for _, text in BENCH_PROMPTS])
    used = {kind: str(name) for kind, name in chosen.items() if kind in heads}
    report = {"model": args.model, "heads": used, **run(model, heads, prompts, config)}
    write(report, args.out)


if __name__ == "__main__":
    main()
