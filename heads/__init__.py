"""Draft heads that ride on the target's hidden states (installed as ``treespec.heads``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from treespec.heads import eagle
from treespec.heads.draft import load_draft
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
    "head_override",
    "load",
    "load_published_eagle",
    "load_published_medusa",
    "register",
    "registered",
    "shipped_for",
    "unregister",
]

_REGISTRY: dict[str, Path] = {}
SHIPPED = Path(__file__).parent / "shipped"  # heads trained by scripts/train_heads.py (docs/training.md)
# target model name -> kind -> shipped head name
SHIPPED_FOR = {
    "smollm2-135m-instruct": {
        "eagle": "smollm2-135m-instruct-eagle",
        "medusa": "smollm2-135m-instruct-medusa",
        "draft": "smollm2-135m-instruct-draft",
    }
}


def _register_shipped() -> None:
    for kinds in SHIPPED_FOR.values():
        for name in kinds.values():
            if (SHIPPED / name / "config.json").is_file():
                _REGISTRY[name] = SHIPPED / name


def shipped_for(model_name: str) -> dict[str, str]:
    """The shipped heads for a registered target model, kind -> head name (only those present)."""
    return {kind: name for kind, name in SHIPPED_FOR.get(model_name, {}).items() if name in _REGISTRY}


def head_override(text: str) -> tuple[str, str]:
    """``KIND=PATH`` as the benches' ``--heads`` take it (a head folder or registered name used
    for that kind instead of the shipped one) -> (kind, path); anything else is a ValueError."""
    kind, sep, path = text.partition("=")
    if not sep or kind not in ("eagle", "medusa", "draft") or not path:
        raise ValueError(f"--heads takes KIND=PATH with KIND eagle, medusa or draft, got {text!r}")
    return kind, path


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


def load(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    target_model: nn.Module | None = None,
) -> nn.Module:
    """Load heads by registered name or from a folder: treespec's own layout (``config.json`` +
    ``model.safetensors``, written by ``save``) or a published one (see ``treespec.heads.layouts``).
    Returns a ``MedusaHeads``, an ``EagleHead``, or (``head_type`` "draft", which needs
    ``target_model`` for the embeddings and LM head it shares) a draft causal LM."""
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
    if head_type == "draft":
        if target_model is None:
            raise ValueError(f"{folder} holds a draft model: pass target_model (it shares its tables)")
        return load_draft(folder, target_model)
    raise ValueError(
        f"{folder}: unknown head layout {head_type!r} (known: treespec 'medusa' and 'eagle'; published "
        "Medusa, EAGLE and EAGLE-3)"
    )


_register_shipped()
