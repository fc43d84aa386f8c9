"""``treespec serve``: an OpenAI-compatible server over the engine (docs/serving.md).

One process: the model loaded once, the engine stepping in its own thread (continuous batching:
requests join while others decode), the HTTP side on asyncio streaming what each step commits.
Needs the ``serve`` extra (FastAPI, uvicorn): ``treespec.serve.server`` (``build``, ``serve``),
``app`` and ``runner`` import them; this package's options (:class:`ServeConfig`) do not.
"""

from __future__ import annotations

from dataclasses import dataclass

from treespec.budget import fixed_budget

PROPOSERS = ("auto", "none", "ngram", "eagle", "medusa", "draft", "hybrid")
ROUTABLE = ("ngram", "eagle", "medusa", "draft", "hybrid")  # what a list of proposers may hold


@dataclass(frozen=True)
class ServeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    proposer: str = "auto"  # one of PROPOSERS, or a comma list of ROUTABLE ones: the first the default
    max_batch: int = 8
    api_key: str | None = None
    max_model_len: int | None = None  # None: the engine's default for the model
    prefill_chunk: int = 512
    dtype: str = "bf16"
    served_model_name: str | None = None
    budget: str = "adaptive"  # named proposers: "adaptive", "fixed" (their own trees), "N" nodes or "N:D"
    max_prefill_tokens: int | None = 128  # prompt tokens per step across requests (None: no bound)

    def __post_init__(self) -> None:
        names = self.proposers
        if len(names) == 1 and names[0] not in PROPOSERS:
            raise ValueError(f"proposer must be one of {', '.join(PROPOSERS)}, got {self.proposer!r}")
        if len(names) > 1 and (len(set(names)) != len(names) or not set(names) <= set(ROUTABLE)):
            raise ValueError(
                f"a list of proposers names distinct ones of {', '.join(ROUTABLE)}, got {self.proposer!r}"
            )
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {self.max_batch!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2 tokens, got {self.max_model_len}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        fixed_budget(self.budget)  # a ValueError naming what is accepted
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")

    @property
    def proposers(self) -> tuple[str, ...]:
        """The proposer names ``proposer`` lists (a request may choose among several)."""
        return tuple(name.strip() for name in self.proposer.split(","))
