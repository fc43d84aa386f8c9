"""The engine's step: admission, the step loop (``loop``), the request state and counts
(``requests``), one step's rows (``step_batch``), its token choices (``picking``), the features
handed to a proposer (``handover``), the proposal check (``proposal_check``) and the step as
values with its timer (``step_state``)."""

from treespec.engine.loop import TOKENIZE_HINT, Engine
from treespec.engine.requests import EngineStats, Request, RequestOutput

__all__ = ["TOKENIZE_HINT", "Engine", "EngineStats", "Request", "RequestOutput"]
