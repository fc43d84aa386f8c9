"""Draft heads that ride on the target's hidden states (installed as ``treespec.heads``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from treespec.heads.medusa import MedusaConfig, MedusaHeads

__all__ = ["MedusaConfig", "MedusaHeads", "load"]


def load(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> MedusaHeads:
    """Load a head folder written by ``save`` (``config.json`` + ``model.safetensors``)."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} is not a head folder: no config.json")
    head_type = json.loads(config_file.read_text()).get("head_type")
    if head_type == "medusa":
        return MedusaHeads.from_folder(folder, dtype=dtype, device=device)
    raise ValueError(f"{folder}: unknown head layout {head_type!r} (known: 'medusa')")
