"""The adaptive tree budget: each step, the tree size that maximises expected tokens per second.

Sequoia's argument: a bigger tree accepts more tokens per step but costs more to score, and the
price of one more token depends on the hardware and on the batch. Three parts:

- :class:`CostModel`: the target's forward time for n new tokens in all (the batch's trees
  together), measured at start-up on this machine (``CostModel.measure``) and interpolated.
- :class:`AcceptanceStats`: running acceptance rates per depth and sibling rank, learned from
  the steps the engine verifies (rank r at depth d: accepted given its parent was).
- :class:`BudgetChooser`: for B requests, picks n drafted nodes per request and a depth cap d
  maximising ``(1 + E[accepted | best tree of n nodes no deeper than d]) / (forward(B * (n + 1))
  + propose(B * n, d))``. E is the sum of the n largest path probabilities no longer than d
  (``tree.best_paths``, the order ``tree.best_tree`` takes), so one pass scores every n and d.
  ``allocate`` makes the same choice request by request: each request's expected gain is the
  table's scaled by what that request's own trees won (its *scale*), and only the k requests
  whose trees win most draft, each a tree of n nodes, at the step's marginal cost for
  ``B + k * n`` rows; the others draft nothing.

:class:`AdaptiveProposer` wraps a proposer that has a settable budget (``has_budget``, with
``set_budget(num_nodes, depth)``: EAGLE, Medusa and draft models with dynamic trees, n-gram
lookup), feeds the stats from the accepted node indices of each step's result, and asks the
chooser before every proposal. What it learns that outlives a request (the acceptance statistics,
decayed; the measured step rates; the drafting times; the probe schedule) lives in a
:class:`BudgetMemory` that the proposers of successive requests share (one per proposer, head and
target). A fixed budget is the wrapped proposer on its own.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from treespec.proposers.base import ProposalRequest, Proposer, RequestResult, StepResult, WrappingProposer
from treespec.target import Target
from treespec.tree import TokenTree, best_paths


def fixed_budget(text: str) -> tuple[int, int | None] | None:
    """A budget as ``treespec bench --budget`` and ``treespec serve --budget`` take it: None for
    ``adaptive`` (the learning budget) or ``fixed`` (the proposer's own tree), else ``(nodes,
    depth)`` from ``N`` (N drafted nodes, as deep as they allow: depth None) or ``N:D`` (at most D
    levels). Anything else is a ValueError naming what is accepted."""
    if text in ("adaptive", "fixed"):
        return None
    nodes, colon, depth = text.partition(":")
    if (
        nodes.isdigit()
        and 1 <= int(nodes) <= 31
        and (not colon or (depth.isdigit() and 1 <= int(depth) <= 8))
    ):
        return int(nodes), int(depth) if depth else None
    raise ValueError(
        f"budget must be 'adaptive', 'fixed', a node count N from 1 to 31 or N:D with a depth D from 1 to 8, "
        f"got {text!r}"
    )


@dataclass
class CostModel:
    """Forward seconds as a function of new tokens in the step (piecewise linear in between)."""

    sizes: list[int]
    seconds: list[float]

    def __post_init__(self) -> None:
        if len(self.sizes) < 2 or len(self.sizes) != len(self.seconds) or self.sizes != sorted(self.sizes):
            raise ValueError(
                f"need >= 2 increasing sizes with one time each, got {self.sizes}, {self.seconds}"
            )

    def __call__(self, tokens: int) -> float:
        sizes, secs = self.sizes, self.seconds
        i = min(max(bisect.bisect_left(sizes, tokens), 1), len(sizes) - 1)
        (a, b), (ta, tb) = (sizes[i - 1], sizes[i]), (secs[i - 1], secs[i])
        return ta + (tb - ta) * (tokens - a) / (b - a)

    def update(self, tokens: int, seconds: float, weight: float = 0.25) -> None:
        """Blend a step actually run (``tokens`` new tokens in ``seconds``) into the curve: an
        exponential moving average at that size (the point is added if it was not measured),
        at weight 0.5 instead of ``weight`` when the step took under 2/3 or over 3/2 of what the
        curve said (not noise: the machine or the model changed). The fresh point is the one
        trusted: the larger sizes, which steps run more rarely, move by the same factor (a
        machine under a new load is slower or faster at every size), then smaller sizes are
        lowered to it and larger ones raised to it, so the curve stays non-decreasing. Keeps a
        start-up calibration from going stale when the machine's load changes."""
        if tokens < 1 or not seconds > 0:
            return
        before = self(tokens)
        if before > 0 and not 2 / 3 <= seconds / before <= 3 / 2:
            weight = max(weight, 0.5)
        i = bisect.bisect_left(self.sizes, tokens)
        if i < len(self.sizes) and self.sizes[i] == tokens:
            self.seconds[i] = (1 - weight) * self.seconds[i] + weight * seconds
        else:
            self.sizes.insert(i, tokens)
            self.seconds.insert(i, seconds)
        fresh = self.seconds[i]
        factor = fresh / before if before > 0 else 1.0
        self.seconds = (
            [min(t, fresh) for t in self.seconds[:i]]
            + [fresh]
            + [max(t * factor, fresh) for t in self.seconds[i + 1 :]]
        )

    def token_cost(self, batch_size: int = 1, drafted: int = 4) -> float:
        """What one more drafted token per request costs, as a fraction of a step without one:
        the curve's mean slope over the first ``drafted`` tokens per request (the n-gram
        proposer's ``token_cost``, measured instead of guessed)."""
        base = self(batch_size)
        return max(0.0, (self(batch_size * (1 + drafted)) - base) / (drafted * base))

    def relative(self) -> dict[int, float]:
        """Cost of each measured size relative to one token."""
        one = self(1)
        return {n: s / one for n, s in zip(self.sizes, self.seconds, strict=True)}

    @classmethod
    @torch.inference_mode()
    def measure(
        cls,
        target: Target,
        *,
        batch_size: int = 1,
        context: int = 256,
        sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
        repeats: int = 5,
        progress: str | None = None,
    ) -> CostModel:
        """Time the target scoring ``n`` new tokens per step (spread over ``batch_size`` requests
        of ``context`` cached tokens each) for each n in ``sizes``: medians of ``repeats``.
        ``progress``: a progress bar with this label, one tick per size."""
        cache = target.new_cache(batch_size, context + max(sizes) + 1)
        slots = [cache.allocate() for _ in range(batch_size)]  # host lists, as the engine's step passes them
        vocab = target.vocab_size
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, vocab, (batch_size * context,), generator=generator)
        target.forward(
            prompt, cache, [b * context for b in range(batch_size + 1)], slots, return_hidden=False
        )
        for s in slots:
            cache.lengths[s] = context
        times = []
        for n in tqdm(sizes, desc=progress, unit="size", disable=progress is None):
            per = [n // batch_size + (b < n % batch_size) for b in range(batch_size)]
            per = [max(p, 1) for p in per]
            cu = list(itertools.accumulate(per, initial=0))
            tokens = torch.randint(0, vocab, (cu[-1],), generator=generator)
            runs = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                target.forward(tokens, cache, cu, slots, return_hidden=False)
                if target.device.type == "cuda":
                    torch.cuda.synchronize(target.device)  # the forward returns before the GPU is done
                runs.append(time.perf_counter() - start)
            times.append(statistics.median(runs[1:]))  # the first run warms up
        return cls(list(sizes), cls.monotone(times))

    @staticmethod
    def monotone(seconds: list[float]) -> list[float]:
        """A step could always be padded to a larger size, so n tokens cost at most what more
        tokens cost: a size measured dearer than a larger one was disturbed (a shared machine),
        and takes the larger one's time."""
        out = list(seconds)
        for i in range(len(out) - 2, -1, -1):
            out[i] = min(out[i], out[i + 1])
        return out


@dataclass
class AcceptanceStats:
    """Running acceptance rates per depth and sibling rank, with a prior worth a few steps."""

    max_depth: int = 8
    max_rank: int = 8
    prior: float = 0.5  # rate assumed at depth 1, rank 0, before any evidence
    prior_weight: float = 4.0
    trials: list[float] = field(init=False)  # [depth] steps whose walk reached a node with children there
    accepted: list[list[float]] = field(init=False)  # [depth][rank] children accepted at that rank

    def __post_init__(self) -> None:
        self.trials = [0.0] * self.max_depth
        self.accepted = [[0.0] * self.max_rank for _ in range(self.max_depth)]

    def update(self, tokens: list[int], parents: list[int], accepted_path: list[int]) -> None:
        """One request's tree and the node indices accepted (the root first, then its accepted
        descendants, in order)."""
        children: dict[int, list[int]] = {}
        for node in range(1, len(tokens)):
            children.setdefault(parents[node], []).append(node)
        path = accepted_path
        for depth, node in enumerate(path):
            kids = children.get(node, [])
            if not kids or depth >= self.max_depth:
                break
            self.trials[depth] += 1
            if depth + 1 < len(path):
                rank = kids.index(path[depth + 1])
                if rank < self.max_rank:
                    self.accepted[depth][rank] += 1

    def fade(self, factor: float) -> None:
        """Forget a little: every count times ``factor`` (once per step), so that what recent
        steps won outweighs what a different kind of prompt won long ago; the prior regains its
        weight where the evidence fades."""
        self.trials = [t * factor for t in self.trials]
        self.accepted = [[a * factor for a in row] for row in self.accepted]

    def rates(self) -> list[list[float]]:
        """[depth][rank] P(the rank-r child at this depth is accepted | its parent was)."""
        table = []
        for d in range(self.max_depth):
            row = []
            for r in range(self.max_rank):
                prior = self.prior / (r + 1) / (d + 1) ** 0.5
                weight = self.trials[d] + self.prior_weight
                row.append((self.accepted[d][r] + self.prior_weight * prior) / weight if weight else prior)
            table.append(row)
        return table


@dataclass
class BudgetChooser:
    forward_cost: CostModel
    # seconds to draft n nodes in all (every drafting request's together) at most d levels deep,
    # (n, d) -> s; None: free
    propose_cost: Callable[[int, int], float] | None = None
    max_nodes: int = 63
    # the same cost as a plane, (intercept, per node, per level) -> what ``allocate`` prices its
    # candidates with inline (it weighs hundreds a step); None: it calls ``propose_cost``
    drafting_plane: Callable[[], tuple[float, float, float]] | None = None
    # the tree sizes ``allocate`` weighs (and the cap itself)
    sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 31, 48, 63)

    def expected_by_depth(
        self, rates: list[list[float]], max_nodes: int, max_pops: int = 4096
    ) -> list[list[float]]:
        """For each depth cap D = 1 .. len(rates): ``tables[D - 1][n]``, the tokens per step of
        the best tree of n nodes no deeper than D (n up to ``max_nodes``, or as many as such trees
        have). The paths no longer than D come out of :func:`treespec.tree.best_paths` in their
        own best order (a prefix of a path is shorter and at least as probable), so one pass
        fills every table. A drafter pays per level, so a wide shallow tree can beat the deep
        one of the same size: the chooser weighs both."""
        depth_count = len(rates)
        capacity, width = [], 1
        for d in range(depth_count):  # paths no longer than D: sum over d <= D of the ranks' product
            width *= len(rates[d])
            capacity.append(min(max_nodes, (capacity[-1] if capacity else 0) + width))
        tables = [[1.0] for _ in range(depth_count)]
        for pops, (prob, path) in enumerate(best_paths(rates)):
            for d in range(len(path) - 1, depth_count):
                if len(tables[d]) <= capacity[d]:
                    tables[d].append(tables[d][-1] + prob)
            if pops >= max_pops or all(len(t) > c for t, c in zip(tables, capacity, strict=True)):
                break
        return tables

    def choose(
        self,
        rates: list[list[float]],
        batch_size: int,
        cap: int | None = None,
        min_nodes: int = 0,
        expected: list[list[float]] | None = None,
    ) -> tuple[int, int, float]:
        """(nodes per request, depth cap, expected tokens per second) for B requests, with at
        least ``min_nodes`` nodes: the best over every depth cap and size. ``expected``: what
        ``expected_by_depth(rates, cap)`` returns, when the caller keeps it (the adaptive proposer
        refreshes it every few steps: it is the costly part)."""
        limit = min(cap or self.max_nodes, self.max_nodes)
        tables = expected if expected is not None else self.expected_by_depth(rates, limit)
        forward = [self.forward_cost(batch_size * (n + 1)) for n in range(limit + 1)]  # once per size
        best = (0, 0, batch_size / forward[0]) if min_nodes == 0 else (0, 0, 0.0)
        for depth, totals in enumerate(tables, start=1):
            for n in range(max(1, min_nodes), min(limit, len(totals) - 1) + 1):
                drafting = self.propose_cost(batch_size * n, depth) if self.propose_cost is not None else 0.0
                rate = batch_size * totals[n] / (forward[n] + drafting)
                if rate > best[2]:
                    best = (n, depth, rate)
        return best

    def allocate(
        self,
        tables: list[list[list[float]]],
        *,
        cap: int | None = None,
        min_nodes: int = 0,
        batch_size: int | None = None,
    ) -> tuple[int, int, int, float]:
        """(k, nodes, depth, expected tokens per second): the first k of the candidate requests
        draft a tree of ``nodes`` nodes no deeper than ``depth`` and the rest of the step's
        ``batch_size`` requests (default: the candidates) draft nothing. ``tables``: per
        candidate, most promising first (each expects at least what the next does at every size),
        what ``expected_by_depth`` says its trees win, from its own acceptance rates. The step
        costs ``forward(B + k * n) + propose(k * n, depth)``: a tree is priced at the rows it
        adds to this step, so at a large batch only the requests whose trees win most draft.
        k = 0 (no tree) unless ``min_nodes`` > 0. The sizes weighed are ``sizes`` (and
        ``min_nodes``), each at the depths it can fill (a cap deeper than n nodes is the same
        tree as a cap of n)."""
        batch = len(tables) if batch_size is None else batch_size
        limit = min(cap or self.max_nodes, self.max_nodes)
        least = max(1, min_nodes)
        sizes = sorted({n for n in (*self.sizes, least, limit) if least <= n <= limit})
        plane = self.drafting_plane() if self.drafting_plane is not None else None
        fixed = self.propose_cost is None
        forward: dict[int, float] = {}
        cost = self.forward_cost
        best = (0, 0, 0, batch / cost(batch)) if min_nodes == 0 else (0, 0, 0, 0.0)
        for depth in range(1, min(len(t) for t in tables) + 1):
            if plane is not None:
                level = plane[0] + plane[2] * depth
            for n in sizes:
                if n < depth:
                    continue
                gain = 0.0  # the first k candidates' expected drafted tokens accepted
                for k, own in enumerate(tables, start=1):
                    totals = own[depth - 1]
                    if n >= len(totals):
                        break
                    gain += totals[n] - 1
                    rows = batch + k * n
                    seconds = forward.get(rows)
                    if seconds is None:
                        seconds = forward[rows] = cost(rows)
                    if plane is not None:
                        drafting = level + plane[1] * k * n
                        seconds += drafting if drafting > 0 else 0.0
                    elif not fixed:
                        seconds += self.propose_cost(k * n, depth)
                    rate = (batch + gain) / seconds
                    if rate > best[3]:
                        best = (k, n, depth, rate)
        return best


def scaled_rates(rates: list[list[float]], scale: float) -> list[list[float]]:
    """A request's acceptance rates: the shared ones times its own ``scale``, each depth's ranks
    together kept below 1 (at most one child is accepted)."""
    out = []
    for row in rates:
        scaled = [r * scale for r in row]
        total = sum(scaled)
        out.append([r * 0.999 / total for r in scaled] if total > 0.999 else scaled)
    return out


@dataclass
class StepThroughput:
    """Tokens per second of the steps actually run, with a tree and without (recent windows).

    The guard that a budget cannot lose: when the measured rate with trees falls below the
    measured rate without, speculating is switched off (but for probes) whatever the model of
    costs and acceptance predicts."""

    window: int = 16
    plain: deque = field(init=False)  # (seconds, tokens) of recent steps without a tree
    tree: deque = field(init=False)  # (seconds, tokens) of recent steps with one

    def __post_init__(self) -> None:
        self.plain, self.tree = deque(maxlen=self.window), deque(maxlen=self.window)

    def record(self, drafted: bool, seconds: float, tokens: int) -> None:
        (self.tree if drafted else self.plain).append((seconds, tokens))

    @staticmethod
    def rate(steps: deque) -> float:
        seconds = sum(s for s, _ in steps)
        return sum(t for _, t in steps) / seconds if seconds > 0 else 0.0

    def trees_lose(self) -> bool:
        """Enough of both kinds measured, and trees commit fewer tokens per second."""
        return len(self.plain) >= 2 and len(self.tree) >= 4 and self.rate(self.tree) < self.rate(self.plain)


@dataclass
class BudgetMemory:
    """What the adaptive budget learns that outlives a request, for one proposer (its head or
    draft model) on one target: the acceptance statistics (faded by ``fade`` every step, so a
    new kind of prompt is learnt), the measured rates of steps with and without a tree, the
    recent drafting times and where the probe schedule stands. The proposers of successive
    requests (a benchmark's prompts, ``generate`` calls) share one, so that none relearns what
    the last one measured; a server's single proposer keeps its own for its whole life."""

    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    throughput: StepThroughput = field(default_factory=StepThroughput)
    fade: float = 0.995  # per observed step: what was learnt 140 steps ago counts half
    drafting: deque = field(default_factory=lambda: deque(maxlen=64))  # (nodes in all, depth, seconds)
    idle: int = 0  # steps since the last tree
    wait: int | None = None  # idle steps before the next probe (None: the proposer's probe_every)
    observed: int = 0  # steps observed

    def __post_init__(self) -> None:
        if not 0.0 < self.fade <= 1.0:
            raise ValueError(f"fade must be in (0, 1], got {self.fade!r}")


@dataclass
class _RequestRecord:
    """One request's own evidence, node by node of its trees' walks: at each node the walk
    reached that had children, the chance the shared statistics gave one of those children
    (``expected``) and whether one was accepted (``won``); both faded at each of its trees."""

    expected: float = 0.0
    won: float = 0.0
    last_tree: int = -1  # the step of its last tree (-1: none yet)
    drafting: bool = False  # it drafts this step

    def scale(self, prior: float) -> float:
        """Its acceptance against the shared rates (each rate times this): 1 before any
        evidence (``prior`` expected acceptances' worth of it)."""
        return (self.won + prior) / (self.expected + prior)


class AdaptiveProposer(WrappingProposer):
    """A proposer whose tree size is chosen every step, request by request, by a
    :class:`BudgetChooser`. It declares what the wrapped proposer declares, but for
    ``has_budget``: it sets the size itself."""

    has_budget = False
    set_budget = Proposer.set_budget  # refused: the chooser sets the wrapped proposer's budget

    def __init__(
        self,
        proposer: Proposer,
        chooser: BudgetChooser,
        stats: AcceptanceStats | None = None,
        probe_every: int = 8,
        clock: Callable[[], float] = time.perf_counter,
        throughput: StepThroughput | None = None,
        refresh: int = 8,
        probe_share: float = 0.02,
        *,
        memory: BudgetMemory | None = None,
        probe_nodes: int = 2,
        request_prior: float = 2.0,
        request_fade: float = 0.9,
    ) -> None:
        """``probe_every``: when speculating does not pay, still draft a tree after this many
        idle steps, so the acceptance estimates keep learning (else a pessimistic start would
        never be corrected). A probe is shallow and cheap: at most ``probe_nodes`` nodes, for
        one request (the one whose last tree is oldest). Each probe that leaves the choice at
        "no tree" doubles the wait, up to 8x; a tree chosen on its merits resets it.

        The steps actually run keep the budget honest: the time from one ``propose`` to the
        next is a whole step, and with the tokens it committed (``observe``) it updates the
        chooser's cost curve at that step's size and a :class:`StepThroughput`. While trees are
        chosen, every ``4 * probe_every``-th step runs without one to measure the baseline
        (every ``probe_every // 2``-th until two are measured); when trees measure slower than
        no tree, none is drafted but for probes. ``clock`` (seconds) is a parameter so that
        tests can drive it.

        ``memory``: what outlives a request (:class:`BudgetMemory`); pass one to the proposers
        of successive requests on one machine (as the chooser's cost curve is shared). Without
        it a fresh one is made from ``stats`` and ``throughput`` (each fresh when None).
        ``refresh``: steps between refreshes of the expected tokens per tree size
        (``_expected``). ``probe_share``: the most that probing may cost, as a share of the
        steps between probes: a probe whose drafting was dear (a draft model catching up a long
        prompt) pushes the next one further out (``_pay_for_probe``).

        Each request's trees are judged by what they won against what the shared statistics
        expected of them (:class:`_RequestRecord`, ``request_prior`` expected drafts of
        evidence for 1 before any, faded by ``request_fade`` at each of its trees): at batch > 1
        only the requests whose trees win most draft (``BudgetChooser.allocate``)."""
        if not isinstance(proposer, Proposer) or not proposer.has_budget:
            raise TypeError(
                f"{type(proposer).__name__} has no settable budget (has_budget is False, no set_budget): its tree size is fixed"
            )
        for name, value in (("probe_every", probe_every), ("probe_nodes", probe_nodes), ("refresh", refresh)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not request_prior > 0 or not 0.0 < request_fade <= 1.0:
            raise ValueError(
                f"request_prior must be > 0 and request_fade in (0, 1], got {request_prior!r}, {request_fade!r}"
            )
        super().__init__(proposer)
        self.chooser = chooser
        if memory is None:
            memory = BudgetMemory(
                stats or AcceptanceStats(), throughput if throughput is not None else StepThroughput()
            )
        self.memory = memory
        if memory.wait is None:
            memory.wait = probe_every
        self.probe_every, self.probe_nodes = probe_every, probe_nodes
        self.request_prior, self.request_fade = request_prior, request_fade
        self.idle_fade = 0.98  # per step a request does not draft: 35 steps halve its evidence
        self.clock = clock
        self._since_plain = 0  # tree steps since the last step without a tree
        self.chosen: list[int] = []  # nodes per drafting request, per step (0: no tree)
        self.drafters: list[int] = []  # requests that drafted, per step
        self._fit: tuple[float, float, float] | None = None  # the drafting times' plane, until it changes
        self._open_step: tuple[float, int, int] | None = (
            None  # (start, drafted nodes, batch) of the step under way
        )
        self.refresh = refresh
        self.probe_share = probe_share
        self._probing = False  # the step under way is a probe
        self._table: list[list[float]] | None = None  # the chooser's expected tokens by depth cap, kept
        self._table_cap = 0  # the most nodes it was made for
        self._rates: list[list[float]] = []  # the shared rates it was made from
        self._scaled: dict[int, list[list[float]]] = {}  # a scale's step -> its table (_own_table)
        self._refreshes = 0  # of the shared table
        self._since_table = 0  # steps observed since the table was made
        self._steps = 0  # proposals made
        self._quiet = 0  # steps left on which the chooser's last "no tree" stands without asking
        self._records: dict[int, _RequestRecord] = {}  # request id -> its own evidence
        self._step_tokens = 0  # tokens committed by the step under way
        self._last_propose_s = 0.0  # the last proposal's whole time, catch-up included
        if chooser.propose_cost is None:
            chooser.propose_cost = self._propose_cost
            chooser.drafting_plane = self._plane

    @property
    def stats(self) -> AcceptanceStats:
        return self.memory.stats

    @property
    def throughput(self) -> StepThroughput:
        return self.memory.throughput

    def scale(self, request_id: int) -> float:
        """How request ``request_id``'s trees win against the shared statistics (1: as
        expected, or no evidence yet)."""
        record = self._records.get(request_id)
        return 1.0 if record is None else record.scale(self.request_prior)

    def _propose_cost(self, nodes: int, depth: int = 1) -> float:
        """Least-squares plane through the recent (nodes in all, depth, seconds) of this
        proposer's drafting: a head pays per node and per level (on a CPU mostly per level).

        The chooser asks for every candidate size each step, so the plane is fitted once per
        new proposal (``_fit``), not once per question."""
        intercept, per_node, per_level = self._plane()
        return max(0.0, intercept + per_node * nodes + per_level * depth)

    def _plane(self) -> tuple[float, float, float]:
        """The drafting times' plane (intercept, per node, per level), fitted once per new
        proposal: what ``BudgetChooser.allocate`` prices every candidate with."""
        if self._fit is None:
            self._fit = self._fit_plane(list(self.memory.drafting))
        return self._fit

    @staticmethod
    def _fit_plane(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
        """(intercept, per node, per level) of seconds against nodes and depth, by least
        squares (the normal equations from one pass of sums: microseconds for 64 points). A
        variable that did not vary among the points gets no slope (a line in the other one, or
        the mean, or zero with no points); when the two vary together (one a function of the
        other), the line that explains more."""
        if not points:
            return 0.0, 0.0, 0.0
        count = float(len(points))
        sn = sd = st = snn = snd = sdd = snt = sdt = 0.0
        for n, d, t in points:
            sn += n
            sd += d
            st += t
            snn += n * n
            snd += n * d
            sdd += d * d
            snt += n * t
            sdt += d * t
        var_n, var_d = snn - sn * sn / count, sdd - sd * sd / count
        varies = (var_n > 1e-9 * max(1.0, snn), var_d > 1e-9 * max(1.0, sdd))
        if all(varies):
            plane = _solve([[count, sn, sd, st], [sn, snn, snd, snt], [sd, snd, sdd, sdt]])
            if plane is not None:
                return plane[0], plane[1], plane[2]
        fits = []
        for i, (sx, sxx, sxt) in enumerate(((sn, snn, snt), (sd, sdd, sdt))):
            if varies[i]:
                slope = (sxt - sx * st / count) / (sxx - sx * sx / count)
                intercept = (st - slope * sx) / count
                residual = sum((intercept + slope * p[i] - p[2]) ** 2 for p in points)
                fits.append((residual, intercept, (slope, 0.0) if i == 0 else (0.0, slope)))
        if not fits:
            return st / count, 0.0, 0.0
        _, intercept, (per_node, per_level) = min(fits)
        return intercept, per_node, per_level

    def _close_step(self, now: float) -> None:
        """The step that began at the last ``propose`` ended now: learn its cost and rate."""
        if self._open_step is None:
            return
        start, drafted, batch = self._open_step
        seconds = now - start
        throughput = self.throughput
        if self._probing:
            plain = throughput.rate(throughput.plain) if throughput.plain else None
            if drafted and plain is not None and self._step_tokens / seconds > plain:
                throughput.tree.clear()  # a probe that beat plain steps: the trees that lost before are stale
            else:
                self._pay_for_probe(seconds, batch)
        throughput.record(drafted > 0, seconds, self._step_tokens)
        drafting = self._last_propose_s if drafted else 0.0
        self.chooser.forward_cost.update(batch + drafted, seconds - drafting)
        self._open_step, self._step_tokens = None, 0

    def _choose(self, requests: list[ProposalRequest]) -> tuple[list[int], int, int]:
        """Which requests draft this step (indices into ``requests``), and their trees' nodes and
        depth: the chooser's pick, overruled by the measured throughput, the baseline steps and
        the probes. While trees measure slower and no probe is due, the chooser is not asked:
        its answer would be overruled."""
        memory, batch = self.memory, len(requests)
        cap = self.max_tree_nodes - 1
        lose = self.throughput.trees_lose()  # measured: trees lose on this machine now
        members: list[int] = []
        nodes = depth = 0
        settled = self._quiet > 0 and memory.idle + 1 < memory.wait  # "no tree" said lately, no probe due
        if settled:
            self._quiet -= 1
        elif not (lose and memory.idle + 1 < memory.wait):
            scales = [self.scale(r.request_id) for r in requests]
            order = sorted(range(batch), key=lambda i: -scales[i])  # most promising first; stable
            tables = [self._own_table(scales[i], cap) for i in order]
            k, nodes, depth, _ = self.chooser.allocate(tables, cap=cap)
            members = [] if lose else sorted(order[:k])
            self._forget_idle(requests, members)
            if not k:  # on its merits, no tree: not asked again for the next refresh - 1 steps
                self._quiet = self.refresh - 1
        if members and self._since_plain >= self._baseline_every():
            members = []  # a baseline step keeps the no-tree rate current
        elif members and self._since_plain % (2 * self.probe_every) == self.probe_every:
            # a step one size up, between baselines: the cost of larger trees and the acceptance of
            # deeper nodes stay measured (else a size once measured dear is never tried again)
            nodes, depth = min(cap, max(nodes + 1, math.ceil(1.5 * nodes))), depth + 1
        if members:
            memory.idle, memory.wait = 0, self.probe_every
            self._since_plain += 1
        else:
            memory.idle += 1
            self._since_plain = 0
        self._probing = False
        if memory.idle >= memory.wait:  # a probe: one request's shallow tree, the one tried longest ago
            b = min(range(batch), key=lambda i: self._last_tree(requests[i].request_id))
            cap = min(cap, self.probe_nodes)
            table = self._own_table(self.scale(requests[b].request_id), self.max_tree_nodes - 1)
            _, nodes, depth, _ = self.chooser.allocate([table], cap=cap, min_nodes=1, batch_size=batch)
            members = [b]
            memory.idle, memory.wait = 0, min(2 * memory.wait, 8 * self.probe_every)
            self._probing = True
        return (members, nodes, depth) if members else ([], 0, 0)

    def _forget_idle(self, requests: list[ProposalRequest], members: list[int]) -> None:
        """A request left out of the trees forgets a little of its evidence each step (its scale
        drifts back to the shared one), so that a request whose text changed kind is tried
        again instead of being judged by its past for ever."""
        drafting = set(members)
        for b, request in enumerate(requests):
            record = self._records.get(request.request_id)
            if b not in drafting and record is not None:
                record.expected *= self.idle_fade
                record.won *= self.idle_fade

    def _last_tree(self, request_id: int) -> int:
        record = self._records.get(request_id)
        return -1 if record is None else record.last_tree

    def _pay_for_probe(self, seconds: float, batch: int) -> None:
        """A probe's step took ``seconds`` (its drafting, a draft model's first one catching up
        the whole prompt, and the scoring of its rows): stretch the wait for the next one so that
        what probing costs beyond a plain step is at most ``probe_share`` of the steps between
        probes, at the measured time of a step without a tree."""
        plain = self.throughput.plain
        step = sum(t for t, _ in plain) / len(plain) if plain else self.chooser.forward_cost(batch)
        if step > 0 and seconds > step:
            self.memory.wait = max(self.memory.wait, math.ceil((seconds - step) / (self.probe_share * step)))

    def _expected(self, cap: int) -> list[list[float]]:
        """The chooser's expected tokens per tree size from the acceptance statistics, kept
        between refreshes: summing the best paths costs about a millisecond of Python, more than
        a step's drafting when trees are off. Refreshed after every observed step for the first
        ``refresh`` steps the memory has seen (the estimates move fast while they are young),
        then every ``refresh``-th, and whenever a larger cap is asked."""
        young = self.memory.observed < self.refresh
        if self._table is None or self._table_cap < cap or young or self._since_table >= self.refresh:
            if self._table_cap < cap or self._refreshes % 4 == 0:
                self._scaled.clear()  # the requests' own tables follow the shared one every 4th time
            self._rates = self.stats.rates()
            self._table = self.chooser.expected_by_depth(self._rates, cap)
            self._table_cap, self._since_table = cap, 0
            self._refreshes += 1
        return self._table

    def _own_table(self, scale: float, cap: int) -> list[list[float]]:
        """The expected tokens of a request whose acceptance is ``scale`` times the shared
        rates: the shared table at 1, else the table of those rates, kept per step of 25 % in
        the scale for four refreshes of the shared one (a batch's requests share a few; a table
        is a millisecond of Python)."""
        shared = self._expected(cap)
        key = round(math.log(min(max(scale, 0.01), 8.0)) / math.log(1.25))
        if key == 0:
            return shared
        if key not in self._scaled:
            self._scaled[key] = self.chooser.expected_by_depth(
                scaled_rates(self._rates, 1.25**key), self._table_cap
            )
        return self._scaled[key]

    def _baseline_every(self) -> int:
        """Tree steps between baseline steps: ``4 * probe_every`` once the guard has its two
        baseline steps, and every ``probe_every // 2`` before, so that a run whose trees lose
        from the start (a fresh proposer per prompt, a prior that favours trees) is caught
        within a few steps instead of after ``4 * probe_every``."""
        if len(self.throughput.plain) < 2:
            return max(1, self.probe_every // 2)
        return 4 * self.probe_every

    def propose(self, requests: list[ProposalRequest]) -> TokenTree:
        now = self.clock()
        self._close_step(now)
        members, nodes, depth = self._choose(requests)
        self.chosen.append(nodes)
        self.drafters.append(len(members))
        self._steps += 1
        if not members:
            self._open_step = (now, 0, len(requests))
            return TokenTree.roots([r.tokens[-1] for r in requests])
        for b in members:
            record = self._records.setdefault(requests[b].request_id, _RequestRecord())
            record.last_tree, record.drafting = self._steps, True
        self.proposer.set_budget(nodes, max(depth, 1))
        tree = self.proposer.propose([requests[b] for b in members])
        seconds = self.clock() - now
        self._open_step = (now, tree.num_nodes - len(members), len(requests))
        # the drafting cost fitted leaves the catch-up out: it grows with the idle steps, not the tree
        self.memory.drafting.append(
            (nodes * len(members), max(depth, 1), max(0.0, seconds - self.proposer.catch_up_s))
        )
        self._last_propose_s = seconds
        self._fit = None
        return tree if len(members) == len(requests) else _beside_roots(tree, members, requests)

    def observe(self, result: StepResult) -> None:
        memory = self.memory
        if memory.fade < 1.0:
            self.stats.fade(memory.fade)
        for request in result.requests:
            record = self._records.get(request.request_id)
            if record is not None and record.drafting:
                record.drafting = False
                self._weigh(record, request)
            self.stats.update(request.tree_tokens, request.tree_parents, request.accepted)
            self._step_tokens += len(request.committed)
        memory.observed += 1
        self._since_table += 1
        self.proposer.observe(result)

    def _weigh(self, record: _RequestRecord, result: RequestResult) -> None:
        """Add one tree's walk to its request's evidence: at each node reached that had
        children, the shared chance that one of them is accepted, and whether one was."""
        if len(result.tree_tokens) < 2 or not self._rates:  # nothing drafted (no n-gram match)
            return
        children: dict[int, int] = {}
        for parent in result.tree_parents[1:]:
            children[parent] = children.get(parent, 0) + 1
        expected = won = 0.0
        path = result.accepted
        for depth, node in enumerate(path):
            kids = children.get(node, 0)
            if not kids or depth >= len(self._rates):
                break
            row = self._rates[depth]
            expected += min(1.0, sum(row[: min(kids, len(row))]))
            won += depth + 1 < len(path)
        fade = self.request_fade
        record.expected, record.won = fade * record.expected + expected, fade * record.won + won

    def release(self, request_id: int) -> None:
        self._records.pop(request_id, None)
        self.proposer.release(request_id)


def _beside_roots(tree: TokenTree, members: list[int], requests: list[ProposalRequest]) -> TokenTree:
    """The drafting requests' ``tree`` (requests ``members``, in order) with every other request's
    root alone, in the requests' order."""
    others = [b for b in range(len(requests)) if b not in set(members)]
    roots = TokenTree.roots([requests[b].tokens[-1] for b in others]).to(tree.tokens.device)
    if tree.draft_probs is not None:  # rows of leaves, never read: kept so the trees concatenate
        roots = replace(roots, draft_probs=tree.draft_probs.new_zeros(len(others), tree.draft_probs.shape[1]))
    order = members + others  # request at each position of the concatenation
    return TokenTree.concat([tree, roots]).select(sorted(range(len(requests)), key=order.__getitem__))


def _solve(augmented: list[list[float]]) -> tuple[float, ...] | None:
    """x with A x = b for the augmented rows [A | b] (Gaussian elimination, partial pivoting);
    None when A is singular."""
    a = [list(row) for row in augmented]
    m = len(a)
    scale = max(abs(x) for row in a for x in row[:m]) or 1.0
    for col in range(m):
        pivot = max(range(col, m), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for i in range(m):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col], strict=True)]
    return tuple(a[i][m] / a[i][i] for i in range(m))
