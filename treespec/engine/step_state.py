"""One engine step as values: what it ran (:class:`StepPlan`), what it kept (:class:`Step`) and
how long each stage took (:class:`StepTimes`, measured by :class:`StepTimer`)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from treespec.engine.requests import Request
from treespec.engine.step_batch import StepBatch
from treespec.proposers.base import RequestResult
from treespec.tree import TokenTree

STAGES = ("propose", "forward", "verify", "commit", "advance")


@dataclass(frozen=True)
class StepTimes:
    """Seconds per stage of one step; ``step_s`` is the whole step, admission and bookkeeping
    included."""

    propose_s: float
    forward_s: float
    verify_s: float
    commit_s: float
    advance_s: float
    step_s: float


class StepTimer:
    """Stage boundaries of one step. On a device that runs asynchronously (CUDA) every mark
    first waits for the device, so a stage is charged its own work and not the queue the stage
    before it left (without it verification, whose read waits for the forward, would absorb the
    forward's time). The CPU runs every op before returning: nothing to wait for there."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.synchronize = torch.cuda.synchronize if device.type == "cuda" else None
        self.marks = [self._now()]

    def _now(self) -> float:
        if self.synchronize is not None:
            self.synchronize(self.device)
        return time.perf_counter()

    def mark(self) -> None:
        """The end of the next stage (in ``STAGES`` order)."""
        if len(self.marks) > len(STAGES):
            raise RuntimeError(f"a step has {len(STAGES)} stages; all were marked")
        self.marks.append(self._now())

    def times(self) -> StepTimes:
        if len(self.marks) != len(STAGES) + 1:
            raise RuntimeError(f"{len(self.marks) - 1} of the step's {len(STAGES)} stages were marked")
        stages = [b - a for a, b in itertools.pairwise(self.marks)]
        return StepTimes(*stages, self.marks[-1] - self.marks[0])


@dataclass(frozen=True)
class StepPlan:
    """What one step runs: the running requests in row order, those among them whose final
    prompt chunk runs (each gets its first token) and those that decode a tree, the trees
    (None without decoding requests), the proposal check's device flag, the flattened rows, and
    the requests that failed in this step's drafting (finished with an error, not run)."""

    running: tuple[Request, ...]
    finishing: tuple[Request, ...]
    decoding: tuple[Request, ...]
    trees: TokenTree | None
    suspect: torch.Tensor | None
    batch: StepBatch | None  # None only when nothing runs: every request failed in drafting
    failed: tuple[Request, ...] = ()


@dataclass(frozen=True)
class Step:
    """One step, done: its plan, one record per request that produced tokens (``results``: the
    requests whose prompt finished, then the decoding ones, as the step's one read brought them
    back, before any cut at EOS or length), the features handed to the proposer (None when it
    reads none) and the stage times."""

    plan: StepPlan
    results: tuple[RequestResult, ...]
    features: torch.Tensor | None
    times: StepTimes | None = None

    @property
    def committed(self) -> dict[int, list[int]]:
        """Per request id, the tokens the step committed before any cut at EOS or length."""
        return {result.request_id: list(result.committed) for result in self.results}
