"""Medusa heads: K extra heads on the target's last hidden state, head i guessing token t+i+1.

Each head is a stack of residual SiLU blocks (``x + SiLU(W x)``, no weight shared between
blocks or heads) followed by a read-out: its own LM head, or the target's. Saved as a folder
with ``config.json`` and ``model.safetensors``.
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

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MedusaConfig.{name} must be an int >= 1, got {value!r}")


class ResidualBlock(nn.Module):
    """x + SiLU(W x + b). Zero-initialised W and b make a new block the identity (as Medusa does)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
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

    def forward(self, hidden: torch.Tensor, target_lm_head: nn.Module | None = None) -> torch.Tensor:
        """Shape: hidden [N, H] -> logits [N, K, V] (head i predicts the token i+1 after the next)."""
        if self.lm_heads is None and target_lm_head is None:
            raise ValueError("these Medusa heads read out through the target's LM head: pass target_lm_head")
        if self.lm_heads is None:  # one read-out for every head: the LM head's weights are read once
            features = torch.stack([blocks(hidden) for blocks in self.blocks], dim=1)  # [N, K, H]
            return target_lm_head(features.flatten(0, 1)).unflatten(0, features.shape[:2])
        return torch.stack(
            [head(blocks(hidden)) for blocks, head in zip(self.blocks, self.lm_heads, strict=True)], 1
        )

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
