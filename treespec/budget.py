"""The adaptive tree budget: each step, the tree size that maximises expected tokens per second.

Sequoia's argument: a bigger tree accepts more tokens per step but costs more to score, and the
price of one more token depends on the hardware and on the batch. Three parts:

- :class:`CostModel`: the target's forward time for n new tokens in all (the batch's trees
  together), measured at start-up on this machine (``CostModel.measure``) and interpolated.
- :class:`AcceptanceStats`: running acceptance rates per depth and sibling rank, learned from
  the steps the engine verifies (rank r at depth d: accepted given its parent was).
- :class:`BudgetChooser`: for B requests, picks n drafted nodes per request and a depth cap d
  maximising ``(1 + E[accepted | best tree of n nodes no deeper than d]) / (forward(B * (n + 1))
  + propose(n, d))``. E is the sum of the n largest path probabilities no longer than d
  (``tree.best_paths``, the order ``tree.best_tree`` takes), so one pass scores every n and d.

:class:`AdaptiveProposer` wraps a proposer that has a settable budget (``has_budget``, with
``set_budget(num_nodes, depth)``: EAGLE, Medusa and draft models with dynamic trees), feeds the
stats from the accepted node indices of each step's result, and asks the chooser before every
proposal. A fixed budget is the
wrapped proposer on its own.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from treespec.proposers.base import ProposalRequest, Proposer, StepResult, WrappingProposer
from treespec.target import Target
from treespec.tree import TokenTree, best_paths


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
        exponential moving average at that size (the point is added if it was not measured).
        The fresh point is the one trusted: smaller sizes are lowered to it and larger ones
        raised to it, so the curve stays non-decreasing. Keeps a start-up calibration from
        going stale when the machine's load changes."""
        if tokens < 1 or not seconds > 0:
            return
        i = bisect.bisect_left(self.sizes, tokens)
        if i < len(self.sizes) and self.sizes[i] == tokens:
            self.seconds[i] = (1 - weight) * self.seconds[i] + weight * seconds
        else:
            self.sizes.insert(i, tokens)
            self.seconds.insert(i, seconds)
        fresh = self.seconds[i]
        self.seconds = (
            [min(t, fresh) for t in self.seconds[:i]]
            + [fresh]
            + [max(t, fresh) for t in self.seconds[i + 1 :]]
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
    # seconds to draft n nodes per request at most d levels deep, (n, d) -> s; None: free
    propose_cost: Callable[[int, int], float] | None = None
    max_nodes: int = 63

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
                seconds = forward[n] + (self.propose_cost(n, depth) if self.propose_cost is not None else 0.0)
                rate = batch_size * totals[n] / seconds
                if rate > best[2]:
                    best = (n, depth, rate)
        return best


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


class AdaptiveProposer(WrappingProposer):
    """A proposer whose tree size is chosen every step by a :class:`BudgetChooser`. It declares
    what the wrapped proposer declares, but for ``has_budget``: it sets the size itself."""

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
    ) -> None:
        """``probe_every``: when speculating does not pay, still draft the best non-empty tree
        after this many idle steps, so the acceptance estimates keep learning (else a
        pessimistic start would never be corrected). Each probe that leaves the choice at "no
        tree" doubles the wait, up to 8x; a tree chosen on its merits resets it.

        The steps actually run keep the budget honest: the time from one ``propose`` to the
        next is a whole step, and with the tokens it committed (``observe``) it updates the
        chooser's cost curve at that step's size and a :class:`StepThroughput`. While trees are
        chosen, every ``4 * probe_every``-th step runs without one to measure the baseline
        (every ``probe_every // 2``-th until two are measured); when trees measure slower than
        no tree, none is drafted but for probes. ``clock``
        (seconds) is a parameter so that tests can drive it. ``throughput``: the measured rates
        to start from and add to; pass one :class:`StepThroughput` to the proposers of successive
        requests on one machine (as the chooser's cost curve is shared) so that each does not
        relearn that trees lose here; acceptance statistics stay each proposer's own.
        ``refresh``: steps between refreshes of the expected tokens per tree size (``_expected``).
        ``probe_share``: the most that probing may cost, as a share of the steps between probes:
        a probe whose drafting was dear (a draft model catching up a long prompt) pushes the
        next one further out (``_pay_for_probe``)."""
        if not isinstance(proposer, Proposer) or not proposer.has_budget:
            raise TypeError(
                f"{type(proposer).__name__} has no settable budget (has_budget is False, no set_budget): its tree size is fixed"
            )
        super().__init__(proposer)
        self.chooser = chooser
        self.stats = stats or AcceptanceStats()
        self.probe_every = probe_every
        self.clock = clock
        self.throughput = throughput if throughput is not None else StepThroughput()
        self._idle = 0  # steps since the last tree
        self._wait = probe_every  # idle steps before the next probe
        self._since_plain = 0  # tree steps since the last step without a tree
        self.chosen: list[int] = []  # nodes per request, per step
        self._propose_times: deque[tuple[int, int, float]] = deque(
            maxlen=64
        )  # (nodes, depth, seconds) of recent proposals
        self._fit: tuple[float, float, float] | None = None  # _propose_times' plane, until it changes
        self._open_step: tuple[float, int, int] | None = None  # (start, nodes, batch) of the step under way
        self.refresh = refresh
        self.probe_share = probe_share
        self._probing = False  # the step under way is a probe
        self._table: list[list[float]] | None = None  # the chooser's expected tokens by depth cap, kept
        self._table_cap = 0  # the most nodes it was made for
        self._observed = self._since_table = 0  # steps observed, and since the table was made
        self._step_tokens = 0  # tokens committed by the step under way
        self._last_propose_s = 0.0  # the last proposal's whole time, catch-up included
        if chooser.propose_cost is None:
            chooser.propose_cost = self._propose_cost

    def _propose_cost(self, nodes: int, depth: int = 1) -> float:
        """Least-squares plane through the recent (nodes, depth, seconds) of this proposer's
        drafting: a head pays per node and per level (on a CPU mostly per level).

        The chooser asks for every candidate size each step, so the plane is fitted once per
        new proposal (``_fit``), not once per question."""
        if self._fit is None:
            self._fit = self._fit_plane(list(self._propose_times))
        intercept, per_node, per_level = self._fit
        return max(0.0, intercept + per_node * nodes + per_level * depth)

    @staticmethod
    def _fit_plane(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
        """(intercept, per node, per level) of seconds against nodes and depth. A variable
        that did not vary among the points gets no slope (a line in the other one, or the mean,
        or zero with no points); when the two vary together, the fit that explains more."""
        if not points:
            return 0.0, 0.0, 0.0
        mean_t = statistics.fmean(t for *_, t in points)
        varies = [len({p[i] for p in points}) > 1 for i in (0, 1)]
        if not any(varies):
            return mean_t, 0.0, 0.0
        x = torch.tensor(
            [[1.0, *(float(p[i]) for i in (0, 1) if varies[i])] for p in points], dtype=torch.float64
        )
        t = torch.tensor([p[2] for p in points], dtype=torch.float64)
        solution = torch.linalg.lstsq(x, t[:, None]).solution[:, 0].tolist()
        slopes = iter(solution[1:])
        return solution[0], *(next(slopes) if varies[i] else 0.0 for i in (0, 1))

    def _close_step(self, now: float) -> None:
        """The step that began at the last ``propose`` ended now: learn its cost and rate."""
        if self._open_step is None:
            return
        start, nodes, batch = self._open_step
        seconds = now - start
        self.throughput.record(nodes > 0, seconds, self._step_tokens)
        drafting = self._last_propose_s if nodes else 0.0
        self.chooser.forward_cost.update(batch * (nodes + 1), seconds - drafting)
        self._open_step, self._step_tokens = None, 0

    def _choose(self, batch: int) -> tuple[int, int]:
        """Nodes per request and depth for this step: the chooser's pick, overruled by the
        measured throughput, the baseline steps and the probes. While trees measure slower and
        no probe is due, the chooser is not asked: its answer would be overruled."""
        cap = self.max_tree_nodes - 1
        lose = self.throughput.trees_lose()  # measured: trees lose on this machine now
        if lose and self._idle + 1 < self._wait:
            nodes = depth = 0
        else:
            nodes, depth, _ = self.chooser.choose(
                self.stats.rates(), batch, cap=cap, expected=self._expected(cap)
            )
            if nodes and lose:
                nodes = depth = 0
        if nodes and self._since_plain >= self._baseline_every():
            nodes = depth = 0  # a baseline step keeps the no-tree rate current
        if nodes:
            self._idle, self._wait = 0, self.probe_every
            self._since_plain += 1
        else:
            self._idle += 1
            self._since_plain = 0
        self._probing = False
        if self._idle >= self._wait:  # a probe: the best tree that drafts something
            nodes, depth, _ = self.chooser.choose(self.stats.rates(), batch, cap=cap, min_nodes=1,
                                                  expected=self._expected(cap))  # fmt: skip
            self._idle, self._wait = 0, min(2 * self._wait, 8 * self.probe_every)
            self._probing = True
        return nodes, depth

    def _pay_for_probe(self, seconds: float, batch: int) -> None:
        """A probe drafted for ``seconds`` (a draft model's first one catches up the whole
        prompt): stretch the wait for the next one so that probing costs at most ``probe_share``
        of the steps between probes, at the measured time of a step without a tree."""
        plain = self.throughput.plain
        step = sum(t for t, _ in plain) / len(plain) if plain else self.chooser.forward_cost(batch)
        if step > 0:
            self._wait = max(self._wait, math.ceil(seconds / (self.probe_share * step)))

    def _expected(self, cap: int) -> list[list[float]]:
        """The chooser's expected tokens per tree size from the acceptance statistics, kept
        between refreshes: summing the best paths costs about a millisecond of Python, more than
        a step's drafting when trees are off. Refreshed after every observed step for the first
        ``4 * refresh`` steps (the estimates move fast while they are young), then every
        ``refresh``-th, and whenever a larger cap is asked."""
        young = self._observed < 4 * self.refresh
        if self._table is None or self._table_cap < cap or young or self._since_table >= self.refresh:
            self._table = self.chooser.expected_by_depth(self.stats.rates(), cap)
            self._table_cap, self._since_table = cap, 0
        return self._table

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
        nodes, depth = self._choose(len(requests))
        self.chosen.append(nodes)
        self._open_step = (now, nodes, len(requests))
        if nodes == 0:
            return TokenTree.roots([r.tokens[-1] for r in requests])
        self.proposer.set_budget(nodes, max(depth, 1))
        tree = self.proposer.propose(requests)
        seconds = self.clock() - now
        # the drafting cost fitted leaves the catch-up out: it grows with the idle steps, not the tree
        self._propose_times.append((nodes, max(depth, 1), max(0.0, seconds - self.proposer.catch_up_s)))
        self._last_propose_s = seconds
        self._fit = None
        if self._probing:
            self._pay_for_probe(seconds, len(requests))
        return tree

    def observe(self, result: StepResult) -> None:
        for request in result.requests:
            self.stats.update(request.tree_tokens, request.tree_parents, request.accepted)
            self._step_tokens += len(request.committed)
        self._observed += 1
        self._since_table += 1
        self.proposer.observe(result)
