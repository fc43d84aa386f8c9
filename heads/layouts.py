"""Published checkpoint layouts, both directions.

Medusa (FasterDecoding/Medusa): a folder with ``config.json`` holding ``medusa_num_heads`` and
``medusa_num_layers`` (and ``base_model_name_or_path``), and the heads' weights in
``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``: the state dict of a ModuleList whose
entry i is ``Sequential(ResBlock x num_layers, Linear(hidden, vocab, bias=False))``, i.e. keys
``{i}.{j}.linear.weight`` / ``{i}.{j}.linear.bias`` for the blocks and ``{i}.{num_layers}.weight``
for the read-out. (The original code repeats one ResBlock object ``num_layers`` times, so its
blocks share weights; the file still holds one entry per block, and treespec loads each into its
own block.)

EAGLE (SafeAILab/EAGLE, EAGLE-1): a Llama ``config.json`` for one layer (``bias`` says whether
``fc`` has one) and ``model.safetensors`` or ``pytorch_model.bin`` with ``fc.weight`` [H, 2H]
(``fc.bias``), ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj
.weight`` and ``layers.0.post_attention_layernorm.weight`` (the layer has no input norm). An
``embed_tokens.weight`` copy of the target's table may be present; the target's own is used.

EAGLE-3 (SafeAILab/EAGLE, as vLLM and SGLang serve it): ``config.json`` with architectures
``["LlamaForCausalLMEagle3"]`` and ``draft_vocab_size`` (optionally
``eagle_aux_hidden_state_layer_ids``), weights ``fc.weight`` [H, 3H], ``midlayer.{input_layernorm,
hidden_norm,post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v}_proj.weight`` [., 2H],
``midlayer.self_attn.o_proj.weight``, ``midlayer.mlp.*``, ``norm.weight``, ``lm_head.weight``
[draft_vocab, H], ``d2t`` (draft id i is target id ``i + d2t[i]``) and ``t2d`` (bool over the
target vocabulary).

A pickle file is read with ``torch.load(weights_only=True)`` only: loading never runs code
from it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig

from treespec.heads.eagle import EagleConfig, EagleHead
from treespec.heads.fit import TargetShape
from treespec.heads.medusa import MedusaConfig, MedusaHeads
from treespec.presets import DEFAULT_MAX_LEN

MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


EAGLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
_LAYER_KEYS = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [
    f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")
] + ["post_attention_layernorm.weight"]  # fmt: skip


def published_layout(folder: Path) -> str | None:
    """ "medusa", "eagle" (EAGLE-1), "eagle3", or None for treespec's own or unknown folders."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if "head_type" in config:
        return None
    if "medusa_num_heads" in config:
        return "medusa"
    if EAGLE3_ARCHITECTURE in config.get("architectures", []) or "draft_vocab_size" in config:
        return "eagle3"
    if "hidden_size" in config and any((folder / name).is_file() for name in EAGLE_WEIGHTS):
        return "eagle"
    return None


def is_published_medusa(folder: Path) -> bool:
    return published_layout(folder) == "medusa"


def load_published_medusa(folder: str | Path) -> MedusaHeads:
    """Medusa heads from the published layout (sizes read from the weights)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    state = _read_weights(folder)
    readout = f"0.{num_layers}.weight"
    if readout not in state:
        raise ValueError(
            f"{folder}: no tensor {readout!r}: not a Medusa head file with {num_layers} layer(s)"
        )
    vocab_size, hidden_size = state[readout].shape
    heads = MedusaHeads(
        MedusaConfig(int(hidden_size), int(vocab_size), num_heads, num_layers, own_lm_head=True)
    )
    ours: dict[str, torch.Tensor] = {}
    missing = []
    for i in range(num_heads):
        for j in range(num_layers):
            for kind in ("weight", "bias"):
                _take(state, f"{i}.{j}.linear.{kind}", f"blocks.{i}.{j}.linear.{kind}", ours, missing)
        _take(state, f"{i}.{num_layers}.weight", f"lm_heads.{i}.weight", ours, missing)
    if missing:
        raise ValueError(f"{folder}: the Medusa checkpoint is missing tensors: {', '.join(missing)}")
    heads.load_state_dict(ours, strict=True)
    return heads.eval()


def export_published_medusa(
    heads: MedusaHeads, folder: str | Path, *, target: nn.Module | PretrainedConfig, base_model: str = ""
) -> Path:
    """Write heads for ``target`` in the published layout (safetensors), as vLLM's ``medusa``
    drafter loads it. Heads that read out through the target's LM head need the model itself
    (not only its config): the published layout stores a read-out per head. Heads of another
    hidden size or vocabulary than the target's are refused, and so are conditioned heads (the
    published layout has no place for their input layers: save them with ``heads.save``)."""
    config = heads.config
    if config.conditioned:
        raise ValueError(
            "conditioned Medusa heads read the drafted tokens through input layers the published "
            "Medusa layout has no place for (vLLM's medusa drafter could not run them): save them in "
            "treespec's own layout with heads.save(folder)"
        )
    TargetShape.of(target).check(
        "the Medusa heads", hidden_size=config.hidden_size, vocab_size=config.vocab_size
    )
    if not config.own_lm_head and not isinstance(target, nn.Module):
        raise ValueError(
            "these heads use the target's LM head: pass the target model, not its config, to export them"
        )
    target_lm_head = None if config.own_lm_head else target.get_output_embeddings()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for i in range(config.num_heads):
        for j in range(config.num_layers):
            block = heads.blocks[i][j].linear
            state[f"{i}.{j}.linear.weight"] = block.weight.detach().clone()
            state[f"{i}.{j}.linear.bias"] = block.bias.detach().clone()
        readout = heads.lm_heads[i] if heads.lm_heads is not None else target_lm_head
        state[f"{i}.{config.num_layers}.weight"] = readout.weight.detach().clone()
    save_file(state, str(folder / MEDUSA_WEIGHTS[0]))
    # hidden_size, vocab_size and medusa_fc_bias are what vLLM reads besides the two counts (it
    # would build 4096-wide heads without biases otherwise, and drop the biases silently)
    meta = {"medusa_num_heads": config.num_heads, "medusa_num_layers": config.num_layers,
            "hidden_size": config.hidden_size, "vocab_size": config.vocab_size, "medusa_fc_bias": True,
            "base_model_name_or_path": base_model}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(meta, indent=2))
    return folder


def _published_eagle_config(config: dict, eagle3: bool) -> EagleConfig:
    """The head's sizes from a published ``config.json``."""
    aux = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    heads = int(config["num_attention_heads"])
    draft_vocab = config.get("draft_vocab_size") if eagle3 else None
    return EagleConfig(
        hidden_size=int(config["hidden_size"]),
        vocab_size=int(config["vocab_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        intermediate_size=int(config["intermediate_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_parameters=_rope_parameters(config),
        max_position_embeddings=int(config.get("max_position_embeddings", DEFAULT_MAX_LEN)),
        hidden_act=config.get("hidden_act", "silu"),
        eagle3=eagle3,
        feature_layers=tuple(aux or ()),
        draft_vocab_size=None if draft_vocab in (None, config["vocab_size"]) else int(draft_vocab),
        fc_bias=bool(config.get("bias", False)) and not eagle3,
        attention_bias=bool(config.get("attention_bias", False)),
    )


def load_published_eagle(folder: str | Path) -> EagleHead:
    """An EAGLE-1 or EAGLE-3 head from its published layout (sizes from ``config.json``)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    eagle3 = published_layout(folder) == "eagle3"
    head = EagleHead(_published_eagle_config(config, eagle3))
    state = _read_eagle_weights(folder)
    ours: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    layer = "midlayer" if eagle3 else "layers.0"
    for key in head.state_dict():
        if key.startswith("layer."):
            _take(state, f"{layer}.{key[len('layer.') :]}", key, ours, missing)
        elif key == "d2t" and "d2t" not in state and head.config.draft_vocab_size is None:
            ours[key] = torch.zeros_like(head.d2t)  # a full read-out vocabulary maps to itself
        else:
            _take(state, key, key, ours, missing)
    if missing:
        raise ValueError(f"{folder}: the EAGLE checkpoint is missing tensors: {', '.join(missing)}")
    head.load_weights(ours, source=str(folder))
    return head.eval()


def export_published_eagle(
    head: EagleHead, folder: str | Path, *, target: nn.Module | PretrainedConfig
) -> Path:
    """Write ``head`` for ``target`` in the published layout (EAGLE-1 or EAGLE-3 by its config;
    safetensors), as vLLM (``eagle`` / ``eagle3``) and SGLang load it. A head of another hidden
    size or vocabulary than the target's, or EAGLE-3 feature layers the target lacks, is refused.
    EAGLE-3 records its feature layers (a head with none gets the target's default ones). An
    EAGLE-1 head's reduced read-out is not part of that layout: the exported head reads out
    through the whole vocabulary."""
    config = head.config
    shape = TargetShape.of(target)
    feature_layers = shape.feature_layers(config)
    shape.check("the EAGLE head", hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                feature_layers=feature_layers)  # fmt: skip
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layer = "midlayer" if config.eagle3 else "layers.0"
    state = {}
    for key, tensor in head.state_dict().items():
        if key == "d2t" and not config.eagle3:
            continue
        name = f"{layer}.{key[len('layer.') :]}" if key.startswith("layer.") else key
        state[name] = tensor.detach().clone().contiguous()
    meta = {k: v for k, v in config.llama_config().to_dict().items() if k not in ("rope_parameters",)}
    meta.update(
        architectures=[EAGLE3_ARCHITECTURE if config.eagle3 else "LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=1,
        rope_theta=float(config.rope_parameters.get("rope_theta", 10000.0)),
        bias=config.fc_bias,
    )
    scaling = {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}
    meta["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    if config.eagle3:
        ids = head.target_ids()
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[ids.cpu()] = True
        state["t2d"] = t2d
        meta["draft_vocab_size"] = config.readout_size
        meta["eagle_aux_hidden_state_layer_ids"] = list(feature_layers)
        meta["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(feature_layers),
            "use_aux_hidden_state": True,
        }
    save_file(state, str(folder / EAGLE_WEIGHTS[0]))
    (folder / "config.json").write_text(json.dumps(meta, indent=2, default=str))
    return folder


def _rope_parameters(config: dict) -> dict:
    if config.get("rope_parameters"):
        return dict(config["rope_parameters"])
    theta = float(config.get("rope_theta", 10000.0))
    scaling = dict(config.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    return {"rope_type": "default", **scaling, "rope_theta": theta}


def _read_eagle_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in EAGLE_WEIGHTS:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
    raise ValueError(f"{folder}: no EAGLE weights ({' or '.join(EAGLE_WEIGHTS)})")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in MEDUSA_WEIGHTS:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                return load_file(str(path))
            state = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
            return {re.sub(r"^medusa_head\.", "", k): v for k, v in state.items()}
    raise ValueError(f"{folder}: no Medusa weights ({' or '.join(MEDUSA_WEIGHTS)})")


def _take(state, source: str, target: str, out: dict, missing: list) -> None:
    if source in state:
        out[target] = state[source]
    else:
        missing.append(source)
