"""Draft heads that ride on the target's hidden states (installed as ``treespec.heads``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from treespec.heads import eagle
from treespec.heads.eagle import EagleConfig, EagleHead
from treespec.heads.layouts import (
    export_published_eagle,
    export_published_medusa,
    load_published_eagle,
    load_published_medusa,
    published_layout,
)
from treespec.heads.medusa import MedusaConfig, MedusaHeads

__all__ = [
    "EagleConfig",
    "EagleHead",
    "MedusaConfig",
    "MedusaHeads",
    "eagle",
    "export_published_eagle",
    "export_published_medusa",
    "load",
    "load_published_eagle",
    "load_published_medusa",
    "register",
    "registered",
    "unregister",
]

_REGISTRY: dict[str, Path] = {}


def register(name: str, folder: str | Path) -> None:
    """Make ``load(name)`` load ``folder``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a head name must be a non-empty string, got {name!r}")
    _REGISTRY[name] = Path(folder)


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def registered() -> dict[str, Path]:
    """Registered head names and their folders."""
    return dict(_REGISTRY)


def load(name_or_path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """Load heads by registered name or from a folder: treespec's own layout (``config.json`` +
    ``model.safetensors``, written by ``save``) or a published one (see ``treespec.heads.layouts``).
    Returns a ``MedusaHeads`` or an ``EagleHead``."""
    folder = _REGISTRY.get(str(name_or_path)) or Path(name_or_path)
    if not folder.is_dir():
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise ValueError(f"{name_or_path!r} is no head folder or registered name (registered: {known})")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} is not a head folder: no config.json")
    layout = published_layout(folder)
    if layout == "medusa":
        return load_published_medusa(folder).to(device=device, dtype=dtype)
    if layout in ("eagle", "eagle3"):
        return load_published_eagle(folder).to(device=device, dtype=dtype)
    head_type = json.loads(config_file.read_text()).get("head_type")
    if head_type == "medusa":
        return MedusaHeads.from_folder(folder, dtype=dtype, device=device)
    if head_type == eagle.HEAD_TYPE:
        return EagleHead.from_folder(folder, dtype=dtype, device=device)
    raise ValueError(
        f"{folder}: unknown head layout {head_type!r} (known: treespec 'medusa' and 'eagle'; published "
        "Medusa, EAGLE and EAGLE-3)"
    )
