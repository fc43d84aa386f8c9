"""The one timer the benchmark suites share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(
    run: Callable[[], object] | Callable[[object], object],
    repeats: int,
    *,
    warmup: int = 1,
    setup: Callable[[], object] | None = None,
    device: str | torch.device = "cpu",
) -> float:
    """Median seconds of ``repeats`` timed calls after ``warmup`` untimed ones. With ``setup``
    (untimed) each call gets a fresh input, ``run(setup())``; else ``run()``. On CUDA the
    device is synchronised before and after each timed call."""
    cuda = torch.device(device).type == "cuda"
    times = []
    for i in range(warmup + repeats):
        state = setup() if setup is not None else None
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(state) if setup is not None else run()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
