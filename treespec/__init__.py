"""treespec: tree speculative decoding for Hugging Face causal language models."""

from treespec.api import GenerationOutput, GenerationStats, generate
from treespec.cache import KVCache
from treespec.engine import Engine, RequestOutput
from treespec.sampling import SamplingParams
from treespec.target import Target

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "GenerationOutput",
    "GenerationStats",
    "KVCache",
    "RequestOutput",
    "SamplingParams",
    "Target",
    "generate",
]
