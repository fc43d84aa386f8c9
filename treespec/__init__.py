"""treespec: tree speculative decoding for Hugging Face causal language models.

Public names are imported lazily, so that ``import treespec`` (and the CLI's light commands)
do not pay for importing transformers.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING

try:  # one place for the version: pyproject.toml, read back from the installed package's metadata
    __version__ = metadata.version("treespec")
except metadata.PackageNotFoundError:  # the sources on sys.path, never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "generate": "treespec.api",
    "GenerationOutput": "treespec.api",
    "GenerationStats": "treespec.api",
    "Engine": "treespec.engine",
    "RequestOutput": "treespec.engine",
    "KVCache": "treespec.target.cache",
    "SamplingParams": "treespec.sampling",
    "Target": "treespec.target",
    "load": "treespec.models",
    "SpeculativeCausalLM": "treespec.wrapper",
}

__all__ = [
    "Engine",
    "GenerationOutput",
    "GenerationStats",
    "KVCache",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeCausalLM",
    "Target",
    "generate",
    "load",
]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from treespec.api import GenerationOutput, GenerationStats, generate
    from treespec.engine import Engine, RequestOutput
    from treespec.models import load
    from treespec.sampling import SamplingParams
    from treespec.target import Target
    from treespec.target.cache import KVCache
    from treespec.wrapper import SpeculativeCausalLM


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'treespec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
