"""Draft heads that ride on the target's hidden states (installed as ``treespec.heads``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from treespec.heads.layouts import export_published_medusa, is_published_medusa, load_published_medusa
from treespec.heads.medusa import MedusaConfig, MedusaHeads

__all__ = ["MedusaConfig", "MedusaHeads", "export_published_medusa", "load", "load_published_medusa"]


def load(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> MedusaHeads:
    """Load a head folder: treespec's own (``config.json`` + ``model.safetensors``, written by
    ``save``) or a published Medusa checkpoint (see ``treespec.heads.layouts``)."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} is not a head folder: no config.json")
    if is_published_medusa(folder):  # FasterDecoding/Medusa's layout
        return load_published_medusa(folder).to(device=device, dtype=dtype)
    head_type = json.loads(config_file.read_text()).get("head_type")
    if head_type == "medusa":
        return MedusaHeads.from_folder(folder, dtype=dtype, device=device)
    raise ValueError(
        f"{folder}: unknown head layout {head_type!r} (known: treespec 'medusa', published Medusa)"
    )
