"""EAGLE heads: one decoder layer that drafts at the feature level, on the target's hidden states.

The head consumes pairs (f_t, x_{t+1}) at sequence position t: a feature f_t and the embedding
(the target's own embedding table) of the token that follows position t. Its output h_t is its
guess of the target's feature at position t + 1, read out as a distribution over x_{t+2}. While
drafting, h_t becomes the feature of the next pair (feature-level autoregression).

Two variants, one module (``EagleConfig.eagle3``):

- **EAGLE-1**: f_t is the target's final (normed) hidden state. ``fc`` fuses [embedding; f_t]
  (2H -> H), then one Llama decoder layer without its input norm; the output goes straight
  through the target's LM head.
- **EAGLE-3**: the target's features are the residual-stream states entering three of its layers
  (low, middle, high: ``feature_layers``, in HF ``hidden_states`` indexing, 0 = embeddings),
  fused by ``fc`` (3H -> H) once, when they come from the target; the head's own outputs are
  used as they are. The decoder layer's attention reads [input_norm(embedding); hidden_norm(f)]
  (2H wide) with f as the residual. The read-out is the head's own ``norm`` and ``lm_head`` over
  a reduced draft vocabulary; ``d2t`` maps draft id i to target id ``i + d2t[i]``.

Attention is handed in as a callable (q, k, v after RoPE -> output), so the same module runs
over a KV cache with tree masks (the proposer) or over whole sequences (training).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from treespec.heads.folder import read_folder, write_folder
from treespec.presets import DEFAULT_MAX_LEN

HEAD_TYPE = "eagle"

# attention(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    vocab_size: int  # the target's
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = DEFAULT_MAX_LEN  # when the target does not say
    hidden_act: str = "silu"
    eagle3: bool = False
    # EAGLE-3: the three target layers whose inputs are fused (HF hidden_states indices); empty:
    # default_feature_layers of the target, resolved when the head meets it
    feature_layers: tuple[int, ...] = ()
    # reduced read-out vocabulary (None: the target's); EAGLE-3 reads out through its own layer,
    # EAGLE-1 through these rows of the target's LM head (``d2t`` names them either way)
    draft_vocab_size: int | None = None
    fc_bias: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EagleConfig.{name} must be an int >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        object.__setattr__(self, "feature_layers", tuple(int(x) for x in self.feature_layers))
        if self.eagle3:
            if len(self.feature_layers) not in (0, 3):
                raise ValueError(
                    f"EAGLE-3 fuses three target layers, got feature_layers={self.feature_layers} "
                    "(or leave it empty for the target's default low / middle / high layers)"
                )
        elif self.feature_layers:
            raise ValueError("feature_layers is an EAGLE-3 option: set eagle3=True")
        if self.draft_vocab_size is not None and not (
            isinstance(self.draft_vocab_size, int) and 1 <= self.draft_vocab_size <= self.vocab_size
        ):
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size!r}"
            )
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"unknown hidden_act {self.hidden_act!r}")

    @property
    def readout_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def feature_size(self) -> int:
        """Width of the target features handed to the head: H, or 3H for EAGLE-3."""
        return self.hidden_size * (3 if self.eagle3 else 1)

    @classmethod
    def from_target(
        cls,
        target_config: PretrainedConfig,
        *,
        eagle3: bool = False,
        feature_layers: tuple[int, int, int] | None = None,
        draft_vocab_size: int | None = None,
    ) -> EagleConfig:
        """A head sized like one decoder layer of the target (its heads, MLP width, RoPE)."""
        config = target_config.get_text_config()
        num_layers = config.num_hidden_layers
        if eagle3 and feature_layers is None:
            feature_layers = default_feature_layers(num_layers)
        rope = getattr(config, "rope_parameters", None) or {
            "rope_type": "default",
            "rope_theta": float(getattr(config, "rope_theta", 10000.0)),
        }
        return cls(
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            rope_parameters=dict(rope),
            max_position_embeddings=getattr(config, "max_position_embeddings", DEFAULT_MAX_LEN),
            hidden_act=_activation(config),
            eagle3=eagle3,
            feature_layers=tuple(feature_layers or ()),
            draft_vocab_size=draft_vocab_size,
        )

    def llama_config(self) -> LlamaConfig:
        """The same sizes as a transformers LlamaConfig (one layer): RoPE and exported configs."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
            attention_bias=self.attention_bias,
        )

    def to_json(self) -> dict:
        return {"head_type": HEAD_TYPE, **asdict(self), "feature_layers": list(self.feature_layers)}


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default low / middle / high layers (as vLLM picks them): (2, L // 2, L - 3),
    clamped into [1, L - 1] for very shallow targets."""
    return tuple(min(max(i, 1), max(num_layers - 1, 1)) for i in (2, num_layers // 2, num_layers - 3))


def _activation(config: PretrainedConfig) -> str:
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"
    return act


class EagleAttention(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        width = config.hidden_size * (2 if config.eagle3 else 1)
        heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(width, heads * dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(width, kv_heads * dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(width, kv_heads * dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * dim, config.hidden_size, bias=config.attention_bias)
        self.shape = (heads, kv_heads, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        heads, kv_heads, dim = self.shape
        rows = x.shape[0]
        q = self.q_proj(x).view(rows, heads, dim).transpose(0, 1)  # [Hq, T, D]
        k = self.k_proj(x).view(rows, kv_heads, dim).transpose(0, 1)
        v = self.v_proj(x).view(rows, kv_heads, dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)  # cos, sin [T, D], per head
        out = attention(q.transpose(0, 1), k.transpose(0, 1), v)  # [T, Hq, D]
        return self.o_proj(out.reshape(rows, heads * dim))


class EagleMLP(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class EagleLayer(nn.Module):
    """The decoder layer. EAGLE-1: no input norm. EAGLE-3: input_layernorm on the embedding,
    hidden_norm on the feature, attention over both (2H wide), the feature as the residual."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.self_attn = EagleAttention(config)
        self.mlp = EagleMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.eagle3:
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        fc_in = config.hidden_size * (3 if config.eagle3 else 2)
        self.fc = nn.Linear(fc_in, config.hidden_size, bias=config.fc_bias)
        self.layer = EagleLayer(config)
        self.rotary = LlamaRotaryEmbedding(config.llama_config())  # inv_freq is not a saved tensor
        if config.eagle3:
            self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.readout_size, bias=False)
        if config.eagle3 or config.draft_vocab_size is not None:
            # draft id i is target id i + d2t[i] (the published EAGLE-3 convention)
            self.register_buffer("d2t", torch.zeros(config.readout_size, dtype=torch.long))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, feature_size] -> the head's feature space [T, H] (EAGLE-3: fc)."""
        if features.shape[-1] != self.config.feature_size:
            raise ValueError(
                f"expected target features of width {self.config.feature_size}, got {features.shape[-1]}"
            )
        return self.fc(features) if self.config.eagle3 else features

    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """One pass over T pairs.

        Shape:
            embeds [T, H] (token embeddings), features [T, H] (fused target features or the head's
            own outputs), positions [T] -> h [T, H], the predicted next features
        """
        layer = self.layer
        if self.config.eagle3:
            residual = features
            x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(features)], dim=-1)
        else:
            x = residual = self.fc(torch.cat([embeds, features], dim=-1))
        cos, sin = self.rotary(x, positions[None].long())
        h = residual + layer.self_attn(x, cos[0], sin[0], attention)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Read-out [T, readout_size]: the target's LM head (EAGLE-1) or the head's own (EAGLE-3)."""
        if self.config.eagle3:
            return self.lm_head(self.norm(h))
        if self.config.draft_vocab_size is not None:  # the rows d2t names (a proposer caches them)
            return nn.functional.linear(h, target_lm_head.weight[self.target_ids()])
        return target_lm_head(h)

    def log_probs(self, h: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Log-probabilities over the target's vocabulary [T, V] (-inf outside a draft vocabulary)."""
        logprobs = torch.log_softmax(self.logits(h, target_lm_head).float(), dim=-1)
        if self.config.draft_vocab_size is None:  # the read-out rows are the target's ids
            return logprobs
        full = logprobs.new_full((logprobs.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.target_ids(), logprobs)

    def target_ids(self) -> torch.Tensor:
        """[readout_size] the target token id of each read-out row."""
        if self.config.draft_vocab_size is None:
            return torch.arange(self.config.vocab_size, device=self.fc.weight.device)
        return torch.arange(self.config.readout_size, device=self.d2t.device) + self.d2t

    def with_readout(self, target_ids: torch.Tensor) -> EagleHead:
        """A copy of this head that reads out only ``target_ids``, a subset of its own read-out's
        target ids (sorted here): each drafting level ranks fewer rows, for a tau measured
        against the full read-out's. An EAGLE-3 head keeps its own LM head's matching rows."""
        if (
            not isinstance(target_ids, torch.Tensor)
            or target_ids.dim() != 1
            or target_ids.dtype.is_floating_point
        ):
            raise TypeError(f"target_ids must be a 1-D integer tensor, got {target_ids!r:.80}")
        ids = target_ids.long().cpu().sort().values
        own = self.target_ids().cpu()
        found = torch.isin(ids, own)
        if not 1 <= len(ids) < len(own) or not bool(found.all()) or bool((ids[1:] == ids[:-1]).any()):
            raise ValueError(
                f"target_ids must be 1 to {len(own) - 1} distinct ids of this head's {len(own)}-row read-out; got "
                f"{len(ids)} ids, {int((~found).sum())} of them outside it"
            )
        row = torch.full((self.config.vocab_size,), -1, dtype=torch.long)
        row[own] = torch.arange(len(own))  # target id -> its row in this head's read-out
        where = row[ids]
        head = EagleHead(replace(self.config, draft_vocab_size=len(ids)))
        state = {k: v for k, v in self.state_dict().items() if k != "d2t"}
        if self.config.eagle3:
            state["lm_head.weight"] = state["lm_head.weight"][where]
        state["d2t"] = ids - torch.arange(len(ids))
        head.load_weights(state, source="with_readout")
        weight = self.fc.weight
        return head.to(device=weight.device, dtype=weight.dtype).train(self.training)

    def save(self, folder: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into ``folder``."""
        return write_folder(folder, self.config.to_json(), self.state_dict())

    @classmethod
    def from_folder(
        cls, folder: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> EagleHead:
        config, state = read_folder(folder, HEAD_TYPE, "an EAGLE head")
        head = cls(EagleConfig(**config))
        head.load_weights(state, source=f"{folder}/model.safetensors")
        return head.to(device=device, dtype=dtype).eval()

    def load_weights(self, state: dict[str, torch.Tensor], *, source: str) -> None:
        """Load a full state dict, naming any missing tensor and any shape that does not fit."""
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ValueError(f"{source} is missing tensors: {', '.join(missing)}")
        for name, tensor in expected.items():
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{source}: tensor {name} has shape {tuple(state[name].shape)}, expected {tuple(tensor.shape)}"
                )
        self.load_state_dict({k: state[k] for k in expected}, strict=True)
