"""Medusa heads: K extra heads on the target's last hidden state, head i guessing token t+i+1.

Each head is a stack of residual SiLU blocks (``x + SiLU(W x)``, no weight shared between
blocks or heads) followed by a read-out: its own LM head, or the target's. Saved as a folder
with ``config.json`` and ``model.safetensors``.

Conditioned heads (``MedusaConfig(conditioned=True)``, as Hydra's heads) also see the tokens
before the one they guess: head i first maps [h_t; E(x_{t+1}); ...; E(x_{t+i+1})] (the target's
state, then the embeddings of the root and of the i tokens drafted before it on the path, from
the target's own table) to one H-wide row (``inputs[i]``, a linear layer initialised to pass h_t
through), then runs its blocks. Plain heads guess depth 2 and 3 from h_t alone, whatever was
drafted at depth 1; conditioned ones draft level by level, each level's rows a path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from treespec.heads.folder import read_folder, write_folder

HEAD_TYPE = "medusa"


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    own_lm_head: bool = True  # False: read out through the target's LM head
    conditioned: bool = False  # True: head i also reads the embeddings of the i + 1 tokens before its guess

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MedusaConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("own_lm_head", "conditioned"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MedusaConfig.{name} must be a bool, got {getattr(self, name)!r}")


class ResidualBlock(nn.Module):
    """x + SiLU(W x + b). Zero-initialised W and b make a new block the identity (as Medusa does)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


def _conditioned_input(hidden_size: int, tokens: int) -> nn.Linear:
    """[h; E(x_1); ...; E(x_tokens)] -> H, initialised to h (the embeddings' columns and the bias
    zero), so a new conditioned head starts as the plain one."""
    layer = nn.Linear(hidden_size * (tokens + 1), hidden_size)
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
        layer.bias.zero_()
    return layer


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.inputs = (
            nn.ModuleList(_conditioned_input(config.hidden_size, i + 1) for i in range(config.num_heads))
            if config.conditioned
            else None
        )
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResidualBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(
                nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)
            )
            if config.own_lm_head
            else None
        )

    def head_features(self, i: int, hidden: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Head ``i``'s row before its read-out. Shape: hidden [N, H], and for conditioned heads
        embeds [N, >= i + 1, H] (the embeddings of the root, then of the tokens drafted at depths
        1 .. i on each row's path; later columns are ignored) -> [N, H]."""
        if self.inputs is not None:
            if (
                embeds is None
                or embeds.dim() != 3
                or embeds.shape[1] < i + 1
                or embeds.shape[0] != len(hidden)
            ):
                got = None if embeds is None else tuple(embeds.shape)
                raise ValueError(
                    f"conditioned Medusa head {i} reads the embeddings of the {i + 1} tokens before its guess: "
                    f"need embeds [{len(hidden)}, >= {i + 1}, {self.config.hidden_size}], got {got}"
                )
            hidden = self.inputs[i](torch.cat([hidden, embeds[:, : i + 1].flatten(1)], dim=1))
        return self.blocks[i](hidden)

    def readout(
        self, i: int, features: torch.Tensor, target_lm_head: nn.Module | None = None
    ) -> torch.Tensor:
        """Head ``i``'s logits from its rows: its own LM head, or the target's."""
        if self.lm_heads is not None:
            return self.lm_heads[i](features)
        if target_lm_head is None:
            raise ValueError("these Medusa heads read out through the target's LM head: pass target_lm_head")
        return target_lm_head(features)

    def forward(
        self,
        hidden: torch.Tensor,
        target_lm_head: nn.Module | None = None,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Shape: hidden [N, H] -> logits [N, K, V] (head i predicts the token i+1 after the next).
        Conditioned heads also take embeds [N, K, H]: the embeddings of the root and of the
        tokens at depths 1 .. K - 1 (teacher-forced in training)."""
        if self.lm_heads is None and target_lm_head is None:
            raise ValueError("these Medusa heads read out through the target's LM head: pass target_lm_head")
        features = [self.head_features(i, hidden, embeds) for i in range(self.config.num_heads)]
        if self.lm_heads is None:  # one read-out for every head: the LM head's weights are read once
            stacked = torch.stack(features, dim=1)  # [N, K, H]
            return target_lm_head(stacked.flatten(0, 1)).unflatten(0, stacked.shape[:2])
        return torch.stack([head(f) for f, head in zip(features, self.lm_heads, strict=True)], 1)

    def save(self, folder: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into ``folder``."""
        return write_folder(folder, {"head_type": HEAD_TYPE, **asdict(self.config)}, self.state_dict())

    @classmethod
    def from_folder(
        cls, folder: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> MedusaHeads:
        config, state = read_folder(folder, HEAD_TYPE, "Medusa heads")
        heads = cls(MedusaConfig(**config))
        missing = sorted(set(heads.state_dict()) - set(state))
        if missing:
            raise ValueError(f"{folder}/model.safetensors is missing tensors: {', '.join(missing)}")
        heads.load_state_dict(state, strict=True)
        return heads.to(device=device, dtype=dtype).eval()
