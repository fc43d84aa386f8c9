"""Does a head fit a target? One check for every place a head meets one: the proposers that draft
with it and the exports that write it for another engine.

A head is tied to its target by three numbers: the hidden size it reads, the vocabulary it drafts
in, and (EAGLE-3) the target layers whose inputs it fuses. A mismatch is refused with both sides
named, before any tensor meets another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from treespec.heads.eagle import EagleConfig, default_feature_layers


@dataclass(frozen=True)
class TargetShape:
    """What a head must agree with: the target's hidden size, vocabulary (its LM head's rows when
    the model is given, else its config's) and number of decoder layers."""

    hidden_size: int
    vocab_size: int
    num_layers: int

    @classmethod
    def of(cls, target: nn.Module | PretrainedConfig) -> TargetShape:
        if isinstance(target, PretrainedConfig):
            config, vocab = target.get_text_config(), None
        elif isinstance(target, nn.Module) and isinstance(getattr(target, "config", None), PretrainedConfig):
            config = target.config.get_text_config()
            vocab = target.get_output_embeddings().weight.shape[0]
        else:
            raise TypeError(
                f"expected the target as a Hugging Face model or its config, got {type(target).__name__}"
            )
        return cls(int(config.hidden_size), int(vocab or config.vocab_size), int(config.num_hidden_layers))

    def feature_layers(self, config: EagleConfig) -> tuple[int, ...]:
        """The target layers whose inputs an EAGLE head fuses: an EAGLE-3 head's own, else this
        target's default low / middle / high ones; none for EAGLE-1."""
        if not config.eagle3:
            return ()
        return config.feature_layers or default_feature_layers(self.num_layers)

    def check(
        self, what: str, *, hidden_size: int, vocab_size: int, feature_layers: Sequence[int] = ()
    ) -> None:
        """Raise ValueError naming both sides unless a head of these sizes fits this target."""
        if hidden_size != self.hidden_size:
            raise ValueError(f"{what} has hidden size {hidden_size}, the target {self.hidden_size}")
        if vocab_size != self.vocab_size:
            raise ValueError(f"{what} has a vocabulary of {vocab_size}, the target {self.vocab_size}")
        layers = tuple(feature_layers)
        if any(not 0 <= layer < self.num_layers for layer in layers):
            raise ValueError(
                f"{what} fuses the inputs of target layers {layers}, which must lie in "
                f"[0, {self.num_layers - 1}]: the target has {self.num_layers} layers"
            )
