"""``treespec bench``: every method and every baseline side by side, in one process, on the
same prompts.

Methods (treespec): ``none`` (autoregressive: the reference), ``ngram`` (n-gram trie), ``draft``
(distilled draft model), ``medusa``, ``eagle`` (EAGLE head, EAGLE-2 dynamic tree), ``hybrid``
(EAGLE branches plus n-gram continuations in one trie). The head methods use the heads shipped
for the model; their tree size is chosen every step by the adaptive budget
(``treespec.budget``) unless ``budget="fixed"``. Baselines: ``hf`` (HF ``generate``), ``hf-pld``
(HF prompt lookup), ``hf-assisted`` (HF assisted generation with the shipped draft).

For each prompt (or batch of prompts) every method runs once, in a fixed interleaved order, so
drift on a shared machine hits all alike. Reported per method: tokens/s (all new tokens over all
seconds), speedup over HF ``generate``, tau (tokens per target step, bonus included), the
accepted-length histogram, per-stage milliseconds per step, and at T=0 how many prompts' outputs
equal the autoregressive reference. A prompt whose output differs is classed by the target's top-2
logit gap where it first differs: a near-tie (the gap within ``near_tie_gap``, a few rounding steps
of the dtype: two ways of summing the same numbers pick different tokens) or a real divergence
(a wide gap: for a treespec method, a bug). The per-prompt details are in the JSON, and printed
with ``verbose``.
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from treespec import heads
from treespec.api import generate
from treespec.budget import AdaptiveProposer, BudgetChooser, BudgetMemory, CostModel, fixed_budget
from treespec.heads.draft import readout_ids
from treespec.kernels import cpu_kernels
from treespec.kernels.tree_attention import BACKENDS as ATTENTION_BACKENDS
from treespec.models import DEFAULT_MODEL, DTYPES, load
from treespec.presets import (
    DRAFT_TREE,
    DRAFT_VOCAB,
    EAGLE_TREE,
    HYBRID_EAGLE_TREE,
    HYBRID_NGRAM_TREE,
    MEDUSA_TREE,
    NGRAM_TREE,
)
from treespec.processors import RowContexts, process
from treespec.prompts import BENCH_PROMPTS, encode_prompts, read_prompt_records
from treespec.proposers import (
    DraftModelProposer,
    EagleProposer,
    HybridProposer,
    MedusaProposer,
    NgramProposer,
)
from treespec.sampling import SamplingParams
from treespec.target import Target
from treespec.target.fused import describe_path
from treespec.target.linear import LINEAR_BACKENDS

METHODS = ("none", "ngram", "draft", "medusa", "eagle", "hybrid")
BASELINES = ("hf", "hf-pld", "hf-assisted")
# The widest top-2 logit gap still called a near-tie: 4 rounding steps of a logit between 16 and 32
# in bf16 and fp16 (the final logits are rounded there); in fp32, the ~1e-5 that summing a forward
# in another order moves logits, with room.
NEAR_TIE_GAP = {"bf16": 4 * 2.0**-3, "fp16": 4 * 2.0**-6, "fp32": 1e-4}


@dataclass(frozen=True)
class BenchConfig:
    model: str = DEFAULT_MODEL
    proposers: tuple[str, ...] = ("all",)
    baselines: tuple[str, ...] = BASELINES
    prompts: str | None = None  # JSON lines; None: treespec's own BENCH_PROMPTS
    num_prompts: int | None = None
    per_category: int | None = None  # the first N prompts of each category
    max_new_tokens: int = 128
    dtype: str = "bf16"
    temperature: float = 0.0
    batch_size: int = 1
    seed: int = 0
    warmup: int = 1
    device: str = "cpu"
    budget: str = "adaptive"  # "fixed": the proposers' own sizes (31 drafted nodes); "N" / "N:D": N nodes every step, D deep
    linear_backend: str = "auto"  # treespec's target (treespec.target.linear); the HF baselines run natively
    attention_backend: str = "auto"  # treespec's target, EAGLE heads and draft models; not the HF baselines
    draft_vocab: int = DRAFT_VOCAB  # EAGLE-1 / Medusa heads read out through the first N token ids (0: all)
    heads: tuple[tuple[str, str], ...] = ()  # (kind, folder or registered name): overrides the shipped heads
    json: str | None = None
    plot: str | None = None
    repetition_penalty: float = 1.0  # HF's, for every method and baseline (1.0: off)
    verbose: bool = False  # print every differing prompt under the table (the JSON always has them)
    tie_gap: float | None = None  # near-tie bound on the top-2 logit gap; None: NEAR_TIE_GAP[dtype]
    methods: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        wanted = [m for p in self.proposers for m in (METHODS if p == "all" else (p,))]
        unknown = [m for m in wanted if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}: choose from {', '.join(METHODS)} or all")
        bad = [b for b in self.baselines if b not in BASELINES]
        if bad:
            raise ValueError(f"unknown baseline(s) {bad}: choose from {', '.join(BASELINES)}")
        object.__setattr__(self, "methods", tuple(dict.fromkeys(["none", *wanted])))  # the reference first
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        fixed_budget(self.budget)  # a ValueError naming what is accepted
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0: off), got {self.repetition_penalty}")
        for name in ("temperature", "warmup", "draft_vocab", "tie_gap"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")

    @property
    def near_tie_gap(self) -> float:
        return NEAR_TIE_GAP[self.dtype] if self.tie_gap is None else self.tie_gap


# --------------------------------------------------------------------------------------------
# Components: heads, proposers, baselines
# --------------------------------------------------------------------------------------------


class Components:
    """The target, tokenizer and shipped heads a run needs, loaded once."""

    def __init__(self, config: BenchConfig) -> None:
        dtype, device = DTYPES[config.dtype], config.device
        self.config = config
        self.hf_model, self.tokenizer = load(config.model, dtype=dtype, device=device)
        self.model = self.hf_model  # one model: the Target runs a view of it and leaves it as it was
        self.target = Target(self.model, attention_backend=config.attention_backend,
                             linear_backend=config.linear_backend)  # fmt: skip
        self.shipped = {**heads.shipped_for(config.model), **dict(config.heads)}
        self._heads: dict[str, object] = {}
        self.cost_model = None
        self._memory: dict[str, BudgetMemory] = {}  # method -> what its budget learnt, kept across prompts

    def head(self, kind: str, *, for_what: str):
        key = (kind, for_what == "hf-assisted")  # HF's copy and treespec's each get their own
        if key not in self._heads:
            if kind not in self.shipped:
                raise ValueError(
                    f"{for_what} needs a head of kind {kind!r} for {self.config.model}, and none is shipped or "
                    f"registered (train one: treespec train-heads train --kind {kind})"
                )
            model = self.hf_model if for_what == "hf-assisted" else self.model
            self._heads[key] = heads.load(self.shipped[kind], dtype=model.dtype, device=self.config.device,
                                          target_model=model)  # fmt: skip
        return self._heads[key]

    def budget_chooser(self):
        if self.cost_model is None:
            self.cost_model = CostModel.measure(self.target, batch_size=self.config.batch_size,
                                                sizes=(1, 2, 4, 8, 16, 32, 64), repeats=3,
                                                progress="calibrating the tree budget")  # fmt: skip
        return BudgetChooser(self.cost_model)

    def proposer(self, method: str):
        """A fresh proposer for one run of ``method`` (None for the autoregressive reference);
        what its budget learnt on earlier runs (the cost curve, and per method the acceptance
        statistics, faded step by step, the measured rates of steps with and without a tree, the
        drafting times and the probe schedule: :class:`treespec.budget.BudgetMemory`) is kept,
        as a server's proposer keeps it from request to request."""
        batch = self.config.batch_size
        if method == "none":
            return None
        if method == "ngram":  # a tree the budget sizes, as the heads' (its own depth rule off)
            return self._adaptive(NgramProposer(**NGRAM_TREE), method)
        linear = self.config.linear_backend  # heads read out with the target's linear backend
        attention = self.config.attention_backend  # EAGLE heads and draft models attend with it
        readout = self._readout("eagle") if method in ("eagle", "hybrid") else None
        if method == "eagle":
            inner = EagleProposer(self.head("eagle", for_what="method 'eagle'"), self.model, **EAGLE_TREE,
                                  max_batch_size=batch, linear_backend=linear,
                                  attention_backend=attention, readout_ids=readout)  # fmt: skip
        elif method == "medusa":
            inner = MedusaProposer(self.head("medusa", for_what="method 'medusa'"), self.model, **MEDUSA_TREE,
                                   linear_backend=linear, readout_ids=self._readout("medusa"))  # fmt: skip
        elif method == "draft":
            inner = DraftModelProposer(self.head("draft", for_what="method 'draft'"), target_model=self.model,
                                       **DRAFT_TREE, max_batch_size=batch, linear_backend=linear,
                                       attention_backend=attention, readout_ids=self._readout("draft"))  # fmt: skip
        else:  # hybrid
            eagle = EagleProposer(self.head("eagle", for_what="method 'hybrid'"), self.model,
                                  **HYBRID_EAGLE_TREE, max_batch_size=batch, linear_backend=linear,
                                  attention_backend=attention, readout_ids=readout)  # fmt: skip
            inner = HybridProposer(eagle, NgramProposer(**HYBRID_NGRAM_TREE))  # one budget sizes both
        return self._adaptive(inner, method)

    def _readout(self, kind: str) -> range | None:
        """The reduced read-out of an EAGLE-1 head, Medusa heads or a draft model (``draft_vocab``
        first ids), or None: the whole vocabulary, or heads with their own (EAGLE-3, an EAGLE-1
        head trained with a draft vocabulary, Medusa heads with their own LM heads, a draft model
        that carries its read-out ids)."""
        head = self.head(kind, for_what=f"method {kind!r}")
        if kind == "draft":  # a draft model: its own (shared) LM head, its own ids if it carries them
            vocab, own = head.get_output_embeddings().weight.shape[0], readout_ids(head) is not None
        elif kind == "medusa":
            vocab, own = head.config.vocab_size, head.config.own_lm_head
        else:
            vocab = head.config.vocab_size
            own = head.config.eagle3 or head.config.draft_vocab_size is not None
        if own or not self.config.draft_vocab or self.config.draft_vocab >= vocab:
            return None
        return range(self.config.draft_vocab)

    def _adaptive(self, proposer, method: str):
        if self.config.budget == "fixed":
            return proposer
        fixed = fixed_budget(self.config.budget)
        if fixed is not None:  # a fixed budget smaller than the proposer's own
            nodes, depth = fixed
            proposer.set_budget(nodes, depth=depth or nodes)  # no depth: as deep as the nodes allow
            return proposer
        memory = self._memory.setdefault(method, BudgetMemory())
        return AdaptiveProposer(proposer, self.budget_chooser(), memory=memory)


def run_method(components: Components, method: str, prompts: list[list[int]], generator_seed: int) -> dict:
    """One method on one batch of prompts: tokens, seconds, and (treespec) its statistics."""
    if method in METHODS:
        return _run_treespec(components, method, prompts, generator_seed)
    return _run_hf(components, method, prompts, generator_seed)


def _run_treespec(components: Components, method: str, prompts: list[list[int]], generator_seed: int) -> dict:
    config = components.config
    generator = torch.Generator(device=components.target.device).manual_seed(generator_seed)
    proposer = components.proposer(method)
    start = time.perf_counter()
    processors = {"repetition_penalty": config.repetition_penalty} if config.repetition_penalty != 1.0 else {}
    out = generate(components.target, prompts, proposer=proposer, max_new_tokens=config.max_new_tokens,
                   eos_token_id=[], temperature=config.temperature, generator=generator, **processors)  # fmt: skip
    seconds = time.perf_counter() - start
    s = out.stats
    lengths = [n for per in s.accepted_lengths for n in per]
    return {"tokens": out.sequences, "seconds": seconds, "steps": s.steps, "accepted_lengths": lengths,
            "drafted_nodes": s.drafted_nodes, "drafting": proposer.drafting_paths() if proposer else {},
            "stages_s": {"propose": s.propose_s, "score": s.forward_s, "verify": s.verify_s,
                         "commit": s.commit_s}}  # fmt: skip


def _hf_options(components: Components, method: str, generator_seed: int) -> dict:
    """HF ``generate``'s options for a baseline: its drafting, the processors, greedy or sampled."""
    config = components.config
    extra: dict = {}
    if method == "hf-pld":
        extra["prompt_lookup_num_tokens"] = 8
    elif method == "hf-assisted":
        extra["assistant_model"] = components.head("draft", for_what="hf-assisted")
    if config.repetition_penalty != 1.0:
        extra["repetition_penalty"] = config.repetition_penalty
    if config.temperature > 0:
        extra.update(do_sample=True, temperature=config.temperature, top_k=0, top_p=1.0)
        torch.manual_seed(generator_seed)
    else:
        extra.update(do_sample=False, top_k=None, top_p=None, temperature=None)
    return extra


def _run_hf(components: Components, method: str, prompts: list[list[int]], generator_seed: int) -> dict:
    model, tokenizer = components.hf_model, components.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    extra = _hf_options(components, method, generator_seed)
    ids, mask = left_pad(prompts, pad)
    forwards = []  # the target's forward passes: prefill, then one per decoding (or verifying) step
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with _hf_notices_off():
            start = time.perf_counter()
            out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                                 max_new_tokens=components.config.max_new_tokens, pad_token_id=pad,
                                 eos_token_id=None, **extra)  # fmt: skip
            seconds = time.perf_counter() - start
    finally:
        hook.remove()
    return {"tokens": out[:, ids.shape[1] :].tolist(), "seconds": seconds, "target_forwards": len(forwards)}


@contextmanager
def _hf_notices_off():
    """HF assisted generation calls the assistant's ``generate`` with a ``generation_config`` and
    loose arguments together, and transformers logs a deprecation notice for it: a call inside
    HF, not one the user made, so the baseline runs with that logger quiet."""
    logger = logging.getLogger("transformers.generation.utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] ids and attention mask, padded on the left as HF generate expects."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def first_divergence(
    components: Components,
    prompt: list[int],
    got: list[int],
    want: list[int],
    memo: dict | None = None,
    params: SamplingParams | None = None,
) -> dict:
    """Where two continuations part, and how close the target's top-2 logits are there (after the
    run's processors, which decided the token). ``memo`` keeps one forward per (prompt,
    reference): the top-2 gap at every reference position."""
    position = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
    key = (tuple(prompt), tuple(want))
    memo = {} if memo is None else memo
    if key not in memo:
        model = components.hf_model
        ids = torch.tensor([prompt + want[:-1]], device=model.device)
        with torch.no_grad():  # rows predicting want[0], ..., want[-1]
            logits = model(ids, logits_to_keep=len(want)).logits[0].float()
        rows = RowContexts([prompt], [len(prompt)], [params or SamplingParams()], [frozenset()], [0] * len(want),
                           [want[:j] for j in range(len(want))])  # fmt: skip
        top = process(logits, rows).topk(2, dim=-1).values
        memo[key] = (top[:, 0] - top[:, 1]).tolist()
    return {"position": position, "got": got[position], "reference": want[position],
            "top2_logit_gap": memo[key][position]}  # fmt: skip


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def run(config: BenchConfig, log: Callable[[str], None] = print) -> dict:
    torch.manual_seed(config.seed)
    pairs = _select_prompts(config)
    log(f"loading {config.model} ({config.dtype}, {config.device})")
    components = Components(config)
    needs_batch_one = [b for b in config.baselines if b in ("hf-pld", "hf-assisted")]
    baselines = [b for b in config.baselines if not (config.batch_size > 1 and b in needs_batch_one)]
    skipped = {b: "HF supports it at batch size 1 only" for b in config.baselines if b not in baselines}
    _load_everything_first(config, components, baselines, log)
    order = [*baselines, *config.methods]
    encoded = encode_prompts(components.tokenizer, [text for _, text in pairs])
    batches = category_batches([c for c, _ in pairs], config.batch_size)
    for _ in tqdm(
        range(config.warmup), desc="warming up every method", unit="round", disable=not config.warmup
    ):
        for method in order:
            run_method(components, method, [encoded[0][:64]], config.seed)
    log(f"{len(pairs)} prompts, {config.max_new_tokens} new tokens each, {len(order)} methods")
    results = _run_batches(config, components, order, encoded, batches)
    report = summarise(config, components, pairs, encoded, results, order)
    report["skipped_baselines"] = skipped
    report["batch_sizes_run"] = dict(sorted(Counter(len(b) for b in batches).items()))  # size -> batches
    report |= _setting(config, components)
    log(format_report(report, verbose=config.verbose))
    if config.json:
        Path(config.json).parent.mkdir(parents=True, exist_ok=True)
        Path(config.json).write_text(json.dumps(report, indent=2))
        log(f"wrote {config.json}")
    if config.plot:
        plot(report, config.plot)
        log(f"wrote {config.plot}")
    return report


def _select_prompts(config: BenchConfig) -> list[tuple[str, str]]:
    """(category, text) of the prompts the run takes: the first ``per_category`` of each
    category, then the first ``num_prompts``."""
    pairs = read_prompt_records(config.prompts) if config.prompts else list(BENCH_PROMPTS)
    if config.per_category is not None:
        taken: Counter = Counter()
        pairs = [p for p in pairs if (taken.update([p[0]]) or taken[p[0]] <= config.per_category)]
    if config.num_prompts is not None:
        pairs = pairs[: config.num_prompts]
    if not pairs:
        raise ValueError("no prompts to run")
    return pairs


def _load_everything_first(config: BenchConfig, components: Components, baselines: list[str], log) -> None:
    """Every head and proposer the run needs, before any timing: a missing one fails here by name,
    and the adaptive budget measures its cost curve once."""
    kinds = sorted({"draft"} & set(baselines) | {k for m in config.methods for k in _HEADS_OF[m]})
    if kinds:
        given = dict(config.heads)
        log("loading heads: " + ", ".join(f"{k} ({given.get(k, 'shipped')})" for k in kinds))
    if "hf-assisted" in baselines:
        components.head("draft", for_what="hf-assisted")
    for method in config.methods:
        components.proposer(method)


def _run_batches(config, components, order: list[str], encoded, batches) -> dict[str, list[dict]]:
    """Every batch through every method in turn (interleaved, so drift hits all alike)."""
    results: dict[str, list[dict]] = defaultdict(list)
    bar = tqdm(total=len(batches) * len(order), desc="bench", unit="run")
    for b, members in enumerate(batches):
        prompts = [encoded[i] for i in members]
        for method in order:
            bar.set_postfix(method=method)
            result = run_method(components, method, prompts, config.seed + b)
            result["prompts"] = members
            results[method].append(result)
            bar.update(1)
    bar.close()
    return results


def _setting(config: BenchConfig, components: Components) -> dict:
    """What the numbers were measured on: machine, the target's backends and path, the cost curve."""
    target = components.target
    setting = {
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "device": config.device},
        "target": {"attention_backend": target.attention_backend, "linear_backend": target.linear_backend,
                   "batch_invariant": target.batch_invariant, "path": target.path, "path_reason": target.path_reason,
                   "cpu_isa": cpu_kernels.isa() if cpu_kernels.available() else None},
    }  # fmt: skip
    if components.cost_model is not None:
        cost = components.cost_model
        setting["forward_cost_ms"] = {n: 1e3 * s for n, s in zip(cost.sizes, cost.seconds, strict=True)}
    return setting


_HEADS_OF = {"none": (), "ngram": (), "draft": ("draft",), "medusa": ("medusa",), "eagle": ("eagle",),
             "hybrid": ("eagle",)}  # fmt: skip


def category_batches(categories: list[str], batch_size: int) -> list[list[int]]:
    """Prompt indices in batches of at most ``batch_size``, each within one category (in order
    of first appearance), so that every category's speed is measured at the batch size run; a
    category with fewer prompts than the batch size runs a smaller batch."""
    by_category: dict[str, list[int]] = defaultdict(list)
    for i, category in enumerate(categories):
        by_category[category].append(i)
    return [
        members[i : i + batch_size]
        for members in by_category.values()
        for i in range(0, len(members), batch_size)
    ]


def summarise(config, components, pairs, encoded, results, order) -> dict:
    new = config.max_new_tokens
    reference = {i: toks for r in results["none"] for i, toks in zip(r["prompts"], r["tokens"], strict=True)}
    methods = []
    gaps: dict = {}  # first_divergence's memo, shared by all methods
    params = SamplingParams(repetition_penalty=config.repetition_penalty)  # the processors every method ran
    categories = sorted({c for c, _ in pairs})
    for name in order:
        runs = results[name]
        seconds = sum(r["seconds"] for r in runs)
        tokens = new * sum(len(r["prompts"]) for r in runs)
        entry: dict = {"name": name, "kind": "baseline" if name in BASELINES else "treespec",
                       "tokens_per_s": tokens / seconds,
                       "per_category": _per_category(runs, pairs, categories, new)}  # fmt: skip
        if "steps" in runs[0]:
            entry |= _step_counts(runs, seconds)
        elif "target_forwards" in runs[0]:  # HF: the tokens after the prefill's over the forwards after it
            entry["mean_accepted_tokens"] = _hf_tau(runs, new)
        if config.temperature == 0:
            entry |= _identity(config, components, runs, reference, encoded, gaps, params, len(pairs))
        else:
            entry["identical_to_reference"] = None  # sampling: the same distribution, not the same tokens
        methods.append(entry)
    for base in SPEEDUP_BASES:
        _speedups(methods, base)
    _drafting_share(methods)
    return {"config": {k: v for k, v in asdict(config).items()}, "categories": categories, "methods": methods,
            "prompts": len(pairs), "near_tie_gap": config.near_tie_gap}  # fmt: skip


def _per_category(runs: list[dict], pairs, categories: list[str], new: int) -> dict:
    """Per category: tokens/s, and tau where the method drafts (treespec's committed tokens per
    decoding step, bonus included; HF's tokens per forward after the prefill)."""
    per_cat = {}
    for category in categories:
        members = [r for r in runs if pairs[r["prompts"][0]][0] == category]
        if not members:
            continue
        seconds = sum(r["seconds"] for r in members)
        per_cat[category] = {"tokens_per_s": new * sum(len(r["prompts"]) for r in members) / seconds}
        lengths = [n for r in members for n in r.get("accepted_lengths", [])]
        if lengths:
            per_cat[category]["tau"] = statistics.fmean(lengths)
        elif "target_forwards" in members[0]:
            per_cat[category]["tau"] = _hf_tau(members, new)
    return per_cat


def _step_counts(runs: list[dict], seconds: float) -> dict:
    """A treespec method's steps: tau, the accepted lengths, the stage times per step, the
    drafted nodes per request and step, and what ran each drafter."""
    lengths = [n for r in runs for n in r["accepted_lengths"]]
    steps = sum(r["steps"] for r in runs)
    stages = {k: sum(r["stages_s"][k] for r in runs) for k in ("propose", "score", "verify", "commit")}
    stages["other"] = max(0.0, seconds - sum(stages.values()))
    return {
        "mean_accepted_tokens": statistics.fmean(lengths) if lengths else 1.0,
        "accepted_length_histogram": dict(sorted(Counter(lengths).items())),
        "stage_ms": {k: 1e3 * v / max(steps, 1) for k, v in stages.items()},
        "steps": steps,  # target forwards, prefill included
        "decode_steps": len(lengths),
        # per request and decoding step: the tree size the budget settled on
        "mean_drafted_nodes": sum(r["drafted_nodes"] for r in runs) / max(len(lengths), 1),
        "drafting": runs[0].get("drafting", {}),  # what ran each drafter: fused, or modules and why
    }


def _identity(config, components, runs, reference, encoded, gaps, params, num_prompts: int) -> dict:
    """Greedy: how many outputs equal plain decoding's, and where each other one first differs
    (a rounding near-tie or a real divergence)."""
    identical, mismatches = 0, []
    for r in runs:
        for i, toks in zip(r["prompts"], r["tokens"], strict=True):
            if toks == reference[i]:
                identical += 1
                continue
            where = first_divergence(components, encoded[i], toks, reference[i], gaps, params)
            mismatches.append(
                {"prompt": i, **where, "near_tie": where["top2_logit_gap"] <= config.near_tie_gap}
            )
    ties = sum(m["near_tie"] for m in mismatches)
    return {"identical_to_reference": identical / num_prompts, "mismatches": mismatches,
            "identity": {"exact": identical, "near_tie": ties, "diverged": len(mismatches) - ties}}  # fmt: skip


# What every method's speed is set against, where it ran: HF generate, and treespec's own plain
# decoding (a speculative method below 1.00x `none` loses to turning speculation off).
SPEEDUP_BASES = ("hf", "none")


def _speedups(methods: list[dict], base: str) -> None:
    """``speedup_vs_<base>`` on every entry and category: tok/s over the base's, in the same run."""
    reference = next((m for m in methods if m["name"] == base), None)
    if reference is None:
        return
    key = f"speedup_vs_{base}"
    for entry in methods:
        entry[key] = entry["tokens_per_s"] / reference["tokens_per_s"]
        for category, values in entry["per_category"].items():
            values[key] = values["tokens_per_s"] / reference["per_category"][category]["tokens_per_s"]


def _drafting_share(methods: list[dict]) -> None:
    """``drafting_vs_plain_step`` on every treespec method: its drafting ms per step over plain
    decoding's scoring ms per step, in the same run (what drafting costs in plain steps)."""
    plain = next((m for m in methods if m["name"] == "none" and "stage_ms" in m), None)
    if plain is None or not plain["stage_ms"]["score"]:
        return
    for entry in methods:
        if entry is not plain and "stage_ms" in entry:
            entry["drafting_vs_plain_step"] = entry["stage_ms"]["propose"] / plain["stage_ms"]["score"]


def _hf_tau(runs: list[dict], new: int) -> float:
    """Tokens per target forward after the prefill, for HF's ``generate``: 1.0 when decoding plainly,
    the mean committed per verification with prompt lookup or an assistant (the last step may be
    cut by ``max_new_tokens``)."""
    steps = sum(r["target_forwards"] - 1 for r in runs)
    return (new - 1) * len(runs) / steps if steps else 1.0


def _path_line(target: dict) -> str:
    """What ran the decoder stack: the fused C stack (on which instruction road) or the model's
    modules, and why not fused."""
    path = target.get("path", "modules")
    if path == "fused":
        return f"fused ({target.get('cpu_isa')})"
    return describe_path(path, target.get("path_reason") or "")


def format_report(report: dict, verbose: bool = False) -> str:
    """The table, its legend, speedups and tau per category, and a closing summary; with
    ``verbose``, where each differing prompt first differs."""
    prompts, gap = report.get("prompts"), report.get("near_tie_gap")
    lines = [f"{'method':<12} {'tok/s':>7} {'vs hf':>6} {'vs none':>7} {'tau':>5} {'nodes':>5} {'same':>4} {'tie':>3} "
             f"{'diff':>4} {'draft':>5}  stage ms/step (propose score verify commit other)  accepted lengths"]  # fmt: skip
    if "target" in report:
        t = report["target"]
        lines.insert(0, f"treespec target: attention {t['attention_backend']}, linear {t['linear_backend']}, "
                        f"batch-invariant {'yes' if t['batch_invariant'] else 'no'}, "
                        f"decoder {_path_line(t)}")  # fmt: skip
    for m in report["methods"]:
        lines.append(_method_row(m))
        lines += _mismatch_lines(m) if verbose else []
    paths = [f"{m['name']}: " + ", ".join(f"{k} {v}" for k, v in m["drafting"].items())
             for m in report["methods"] if m.get("drafting")]  # fmt: skip
    if paths:
        lines.append("drafting through: " + "; ".join(paths))
    lines.append(legend(report))
    lines += _per_category_lines(report)
    if prompts is not None and gap is not None:
        lines.append(summary_line(report))
    return "\n".join(lines)


def _method_row(m: dict) -> str:
    identity = m.get("identity")
    same, tie, diff = (identity["exact"], identity["near_tie"], identity["diverged"]) if identity else "---"
    tau = f"{m['mean_accepted_tokens']:.2f}" if "mean_accepted_tokens" in m else "-"
    nodes = f"{m['mean_drafted_nodes']:.1f}" if "mean_drafted_nodes" in m else "-"
    speed, plain = (f"{m[k]:.2f}x" if k in m else "-" for k in ("speedup_vs_hf", "speedup_vs_none"))
    share = f"{m['drafting_vs_plain_step']:.2f}" if "drafting_vs_plain_step" in m else "-"
    stages = " ".join(f"{v:6.1f}" for v in m["stage_ms"].values()) if "stage_ms" in m else ""
    hist = " ".join(f"{k}:{v}" for k, v in m.get("accepted_length_histogram", {}).items())
    return (f"{m['name']:<12} {m['tokens_per_s']:7.1f} {speed:>6} {plain:>7} {tau:>5} {nodes:>5} {same:>4} "
            f"{tie:>3} {diff:>4} {share:>5}  {stages}  {hist}")  # fmt: skip


def _mismatch_lines(m: dict) -> list[str]:
    lines = []
    for mismatch in m.get("mismatches", []):
        kind = "near-tie" if mismatch.get("near_tie") else "REAL DIVERGENCE"
        lines.append(f"    prompt {mismatch['prompt']}: first differs at token {mismatch['position']} "
                     f"({mismatch['got']} vs {mismatch['reference']}); target's top-2 logit gap there "
                     f"{mismatch['top2_logit_gap']:.4f}: {kind}")  # fmt: skip
    return lines


def _per_category_lines(report: dict) -> list[str]:
    """Speedups against each base, then tau, per category."""
    lines, cats = [], report["categories"]
    for base in SPEEDUP_BASES:
        rows = [m for m in report["methods"] if f"speedup_vs_{base}" in m]
        if rows:
            lines.append(f"speedup vs {base} per category: " + ", ".join(cats))
        for m in rows:
            lines.append(
                f"  {m['name']:<12} "
                + " ".join(f"{m['per_category'][c][f'speedup_vs_{base}']:5.2f}x" for c in cats)
            )
    taus = [  # not none and hf: one token per step by definition
        m for m in report["methods"]
        if m["name"] not in ("none", "hf") and all("tau" in m["per_category"].get(c, {}) for c in cats)
    ]  # fmt: skip
    if taus:
        lines.append("tau (tokens per step) per category: " + ", ".join(cats))
        for m in taus:
            lines.append(
                f"  {m['name']:<12} " + " ".join(f"{m['per_category'][c]['tau']:5.2f} " for c in cats)
            )
    return lines


def legend(report: dict) -> str:
    """One line: what each column means."""
    prompts, gap = report.get("prompts", "all"), report.get("near_tie_gap")
    sampled = report["config"].get("temperature", 0) > 0
    identity = (
        "same/tie/diff: not checked when sampling (the same distribution, not the same tokens)"
        if sampled
        else f"same/tie/diff: of {prompts} prompt{'s' if prompts != 1 else ''}, output equal to `none` (plain decoding) / first differing "
        f"where the target's top-2 logits are within {gap:g} (a {report['config'].get('dtype', '')} rounding "
        "near-tie) / differing beyond that (a bug in a treespec method)"
    )
    return (
        "legend: tok/s new tokens per second; vs hf speed over HF generate; vs none speed over treespec's own "
        "plain decoding (no proposer); tau tokens committed per target "
        f"forward (bonus included); nodes drafted tree nodes per step; {identity}; draft drafting ms per step "
        "over plain decoding's scoring ms per step; stage ms per step; "
        "accepted lengths tokens:steps"
    )


def summary_line(report: dict) -> str:
    """The fastest method, and whether the treespec methods and the baselines kept the target's
    output (how many prompts first differ at a near-tie, and any real divergence by name)."""
    methods = report["methods"]
    fastest = max(methods, key=lambda m: m["tokens_per_s"])
    speed = f", {fastest['speedup_vs_hf']:.2f}x HF generate" if "speedup_vs_hf" in fastest else ""
    text = f"summary: fastest {fastest['name']} ({fastest['tokens_per_s']:.1f} tok/s{speed})"
    speculative = [m for m in methods if m["kind"] == "treespec" and m["name"] != "none"]
    if speculative and "speedup_vs_none" in speculative[0]:
        best = max(speculative, key=lambda m: m["tokens_per_s"])
        worst = min(speculative, key=lambda m: m["tokens_per_s"])
        text += (f"; best speculative method {best['name']} at {best['speedup_vs_none']:.2f}x plain decoding, "
                 f"slowest {worst['name']} at {worst['speedup_vs_none']:.2f}x")  # fmt: skip
    checked = [m for m in methods if m.get("identity") and m["name"] != "none"]
    if not checked:
        return text + "; output identity not checked (sampling)"
    prompts, gap = report["prompts"], report["near_tie_gap"]
    for kind, label in (("treespec", "treespec's methods"), ("baseline", "the baselines")):
        group = [m for m in checked if m["kind"] == kind]
        if not group:
            continue
        exact = sum(m["identity"]["exact"] for m in group)
        ties = sum(m["identity"]["near_tie"] for m in group)
        if exact == prompts * len(group):
            text += f"; {label} kept the target's output on " + (
                f"all {prompts} prompts" if prompts > 1 else "the prompt"
            )
        else:
            text += f"; {label} on {exact} of {prompts * len(group)} method-prompt runs"
            if ties:
                text += f", {ties} first differing at a near-tie (top-2 gap <= {gap:g})"
    diverged = [m for m in checked if m["identity"]["diverged"]]
    if diverged:
        named = ", ".join(f"{m['name']} ({m['identity']['diverged']})" for m in diverged)
        text += f"; REAL DIVERGENCE (gap > {gap:g}) in {named}: see the JSON's mismatches"
    return text


def plot(report: dict, path: str) -> None:
    """Speedup per method per prompt category, and the accepted-length histograms."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install 'treespec[plot]'") from exc
    cats = report["categories"]
    bases = [b for b in SPEEDUP_BASES if any(f"speedup_vs_{b}" in m for m in report["methods"])]
    fig, axes = plt.subplots(1, len(bases) + 1, figsize=(7 * (len(bases) + 1), 4.5))
    names = {"hf": "HF generate", "none": "treespec's plain decoding (none)"}
    for panel, base in zip(axes, bases, strict=False):
        key = f"speedup_vs_{base}"
        methods = [m for m in report["methods"] if key in m]
        width = 0.8 / max(len(methods), 1)
        for k, m in enumerate(methods):
            xs = [i + k * width for i in range(len(cats))]
            panel.bar(xs, [m["per_category"][c][key] for c in cats], width, label=m["name"])
        panel.axhline(1.0, color="black", linewidth=0.8)
        panel.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats)
        panel.set_ylabel(f"speedup over {names[base]}")
    axes[0].legend(fontsize=8)
    right = axes[-1]
    for m in report["methods"]:
        hist = m.get("accepted_length_histogram")
        if hist and m["name"] != "none":
            total = sum(hist.values())
            right.plot(list(hist), [v / total for v in hist.values()], marker="o", label=m["name"])
    right.set_xlabel("tokens committed per step")
    right.set_ylabel("fraction of steps")
    right.legend(fontsize=8)
    fig.suptitle(
        f"{report['config']['model']} {report['config']['dtype']}, batch {report['config']['batch_size']}"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
