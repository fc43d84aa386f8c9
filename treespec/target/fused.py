"""The fused decoder: a Llama-style model's whole layer stack in one C call per step.

Through the model's own modules a single-token step of a 30-layer model is ~4,900 PyTorch
operators, and on a CPU their dispatch and Python cost as much as reading the weights
(docs/results/). ``treespec_decoder_bf16`` (:mod:`treespec.kernels.cpu_kernels`) runs every
layer (RMSNorm, q/k/v, rotary, tree attention, o-proj, residual, RMSNorm, gate/up, SiLU x up,
down, residual) and the final norm in one OpenMP region, over the same weight tensors as the
model (nothing is copied). What stays in Python per step is the embedding lookup, the rotary
tables of the step's positions (the model's own rotary module, so every RoPE scaling it knows is
served), the LM head (treespec's linear kernel) and the step's metadata.

It rounds to bf16 wherever the Hugging Face model does, and every row is computed by one fixed
sequence whatever the rows beside it, so it is batch-invariant as the per-module path is, and
differs from that path only by RMSNorm's summation order and the exponential's last bit; tests
hold the two to each other and speculation to plain decoding on this path.

It serves bf16 models of the families whose layers it reproduces exactly (Llama, Qwen2,
Mistral without a sliding window: SiLU-gated MLP without biases, optional q/k/v biases, full
rotary) on a CPU where treespec's kernels build. Anything else runs through the modules, and
:func:`fused_refusal` says why; ``TREESPEC_FUSED=0`` turns the fused path off everywhere.
"""

from __future__ import annotations

import ctypes
import operator
import os
import warnings

import torch
from torch import nn

from treespec.kernels import cpu_kernels

# Model classes whose decoder layer is exactly the sequence the C stack computes. Subclasses are
# not taken: they may change the layer's forward.
FAMILIES = {
    "LlamaForCausalLM": ("LlamaDecoderLayer", "LlamaRMSNorm"),
    "Qwen2ForCausalLM": ("Qwen2DecoderLayer", "Qwen2RMSNorm"),
    "MistralForCausalLM": ("MistralDecoderLayer", "MistralRMSNorm"),
}
# a layer's entries in the C stack's pointer table (decoder.c's W_* order); embed_norm is an EAGLE-3
# head layer's alone (None in a model's layers)
_SLOTS = ("input_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down", "q_bias", "k_bias", "v_bias",
          "embed_norm")  # fmt: skip
_BIASES = tuple(i for i, name in enumerate(_SLOTS) if name.endswith("_bias"))
_LINEARS = tuple(i for i, name in enumerate(_SLOTS) if name in ("q", "k", "v", "o", "gate", "up", "down"))
_VERSION = operator.attrgetter("_version")


class StackTable:
    """The pointer table the C stack reads for some layers' tensors (``len(_SLOTS)`` a layer, None
    for an empty slot): biases widened to fp32, linear weights as the road reads them
    (:func:`treespec.kernels.cpu_kernels.road_weight`: panels on the AVX2 road). Both are copies,
    so :meth:`current` rebuilds the table when a tensor is replaced or updated in place (its
    version counter moves) or the road changes; the same tensors cost a version read each."""

    def __init__(self) -> None:
        self._ids: tuple[int, ...] | None = None  # of the tensors the table was built from
        self._panels = False  # whether the road read panels then
        self._sources: list[torch.Tensor | None] = []  # those tensors
        self._copied: list[torch.Tensor] = []  # those of them the table holds copies of
        self._version = 0  # the sum of their version counters then
        self._kept: list[torch.Tensor | None] = []  # what the table points at
        self._table: ctypes.Array | None = None

    def current(self, tensors: list[torch.Tensor | None]) -> ctypes.Array:
        # the same tensors (by id: the table holds them, so no id is reused meanwhile), none
        # updated in place (version counters only grow: their sum moves with any of them), the
        # same road
        ids = tuple(map(id, tensors))
        if ids == self._ids and self._panels == cpu_kernels.reads_panels():
            try:
                if sum(map(_VERSION, self._copied)) == self._version:
                    return self._table
            except RuntimeError:  # inference tensors: no version counter (nor in-place updates outside one)
                return self._table
        kept, pointers, copied = [], [], []
        for index, tensor in enumerate(tensors):
            if tensor is not None and index % len(_SLOTS) in _BIASES + _LINEARS:
                copied.append(tensor)
                # biases go in as fp32 (exact widenings), linear weights as the road reads them
                tensor = (
                    tensor.detach().float()
                    if index % len(_SLOTS) in _BIASES
                    else cpu_kernels.road_weight(tensor)
                )
            kept.append(tensor)
            pointers.append(None if tensor is None else tensor.data_ptr())
        self._ids, self._panels = ids, cpu_kernels.reads_panels()
        self._sources, self._kept, self._copied = list(tensors), kept, copied
        try:
            self._version = sum(map(_VERSION, copied))
        except RuntimeError:
            self._version = -1
        self._table = (ctypes.c_void_p * len(pointers))(*pointers)
        return self._table


_SAID: set[str] = set()


def say_once(message: str) -> None:
    """A fallback's reason, warned once per process."""
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def env_refusal() -> str | None:
    """Why the environment turns the fused path off (``TREESPEC_FUSED=0``), or None."""
    value = os.environ.get("TREESPEC_FUSED", "").strip().lower()
    if value in ("", "1", "true", "on", "auto"):
        return None
    if value in ("0", "false", "off"):
        return "turned off by TREESPEC_FUSED=0"
    raise ValueError(f"TREESPEC_FUSED must be 0 or 1, got {value!r}")


def native_refusal(embed: torch.Tensor | None = None) -> str | None:
    """Why a drafter that could build its trees in one C call does not (``TREESPEC_NATIVE_TREE=0``,
    embeddings the C tree cannot read), or None."""
    if os.environ.get("TREESPEC_NATIVE_TREE", "1").strip().lower() in ("0", "false", "off"):
        return "turned off by TREESPEC_NATIVE_TREE=0"
    if embed is not None and not (embed.dtype is torch.bfloat16 and embed.is_contiguous()):
        return "the target's embeddings are not contiguous bf16"
    return None


def choose_native(native: bool | None, refusal: str | None) -> tuple[bool, str]:
    """A drafter's ``native`` argument against why it cannot build its trees in one C call
    (``refusal``, None: it can): (whether it does, why not: "" when it does). ``native=True``
    with a refusal raises it; False turns the one call off."""
    if native is False:
        return False, "native=False"
    if refusal is not None and native:
        raise ValueError(f"native=True: {refusal}")
    return refusal is None, refusal or ""


def fused_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot run through the fused decoder here, or None when it can."""
    if (reason := env_refusal()) is not None:
        return reason
    name = type(model).__name__
    if name not in FAMILIES:
        return f"the fused decoder serves {', '.join(FAMILIES)}; this is {name}"
    if model.device.type != "cpu" or model.dtype != torch.bfloat16:
        return f"the fused decoder is for bf16 models on a CPU; this one is {model.dtype} on {model.device}"
    if not cpu_kernels.available():
        return f"the fused decoder needs treespec's CPU kernels: {cpu_kernels.unavailable_reason()}"
    if (reason := _config_refusal(name, model.config)) is not None:
        return reason
    for index, layer in enumerate(model.model.layers):
        if (reason := _layer_refusal(index, layer, *FAMILIES[name])) is not None:
            return reason
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None or not head.weight.is_contiguous():
        return "the LM head is not a bias-free nn.Linear with a contiguous weight"
    return None


def _config_refusal(name: str, config) -> str | None:
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"{name} uses a sliding window, which the fused decoder does not have"
    if getattr(config, "hidden_act", None) != "silu":
        return f"the fused decoder's MLP is SiLU-gated; this model's activation is {config.hidden_act!r}"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1 splits the linear layers in a way the fused decoder does not"
    return None


def _layer_refusal(index: int, layer: nn.Module, layer_class: str, norm_class: str) -> str | None:
    """Why decoder layer ``index`` is not the plain layer the fused stack computes, or None."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if type(layer).__name__ != layer_class or not all(type(m) is nn.Linear for m in linears):
        return f"layer {index} is not a plain {layer_class} of nn.Linear layers"
    if any(type(n).__name__ != norm_class for n in norms):
        return f"layer {index}'s norms are not {norm_class}"
    if any(m.bias is not None for m in (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        return f"layer {index} has o-proj or MLP biases, which the fused decoder does not add"
    if any(hasattr(attn, norm) for norm in ("q_norm", "k_norm")):
        return f"layer {index} normalises q and k, which the fused decoder does not"
    tensors = [p for m in (*linears, *norms) for p in m.parameters()]
    if not all(p.dtype is torch.bfloat16 and p.is_contiguous() for p in tensors):
        return f"layer {index} has parameters that are not contiguous bf16"
    return None


def rotary_tables(rotary: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, head_dim: int) -> tuple:
    """(cos, sin) [T, D] bf16 of the rows' positions from the model's own rotary module (every
    RoPE scaling it knows), checked against what the C stack reads."""
    cos, sin = rotary(hidden[None], positions[None])
    cos, sin = cos[0].contiguous(), sin[0].contiguous()
    if cos.dtype is not torch.bfloat16 or cos.shape != (len(hidden), head_dim):
        raise ValueError(
            f"expected bf16 rotary tables [{len(hidden)}, {head_dim}], got {cos.dtype} {tuple(cos.shape)}"
        )
    return cos, sin


class RotaryTable:
    """``rotary_tables`` by position from a table computed once and grown by doubling, for the
    rotary modules whose tables do not depend on the call (inv_freq fixed at construction: the
    default, linear, Llama 3 and YaRN scalings): each position's row is the same elementwise
    product whatever positions share the call, so the table gives the module's own bits. Other
    kinds (dynamic NTK, LongRoPE) are computed per call. Saves the module's ~0.1 ms per pass."""

    STATIC = ("default", "linear", "llama3", "yarn")

    def __init__(self, rotary: nn.Module, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> None:
        self.rotary, self.head_dim, self.dtype = rotary, head_dim, dtype
        self.static = getattr(rotary, "rope_type", "default") in self.STATIC
        self.cos = self.sin = torch.empty(0, head_dim, dtype=dtype)

    def covering(self, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole table, rows 0 .. at least ``last``: cos, sin [>= last + 1, D] (static kinds)."""
        if len(self.cos) <= last:
            size = max(2 * len(self.cos), last + 1, 256)
            probe = torch.empty(size, 0, dtype=self.dtype)
            self.cos, self.sin = rotary_tables(self.rotary, probe, torch.arange(size), self.head_dim)
        return self.cos, self.sin

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :func:`rotary_tables` gives them for ``positions`` [T] (``hidden``: their rows)."""
        if not self.static or hidden.dtype != self.dtype:
            return rotary_tables(self.rotary, hidden, positions, self.head_dim)
        cos, sin = self.covering(int(positions.max()) if len(positions) else 0)
        return cos[positions], sin[positions]


def draft_tree(
    stack: tuple,
    rotary: RotaryTable,
    readout: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    cache: object,
    requests: tuple[list[int], list[int]],
    roots: tuple[torch.Tensor | None, torch.Tensor | None],
    shape: tuple[int, int, int],
    catch_up: tuple[list[int], torch.Tensor | None, list[int]] | None = None,
) -> tuple[tuple[torch.Tensor, ...], float]:
    """A drafter's EAGLE-2 tree per request in one C call (``kernels/draft_tree.c``): every
    level's pass, log-softmax, top-k, the frontier and the rerank inside. ``stack`` and
    ``readout`` as :func:`treespec.kernels.cpu_kernels.draft_tree_bf16` takes them, ``requests``
    (cache slots, root tokens), ``roots`` (root features [B, H] or None, root logits [B, V] or
    None), ``shape`` (top_k, depth, num_nodes). Level s of request b runs at position committed
    + s - 1, its K/V written past the committed length (nothing drafted is committed).

    ``catch_up`` (tokens, an EAGLE head's target features [C, H] or None, per request its count
    >= 1): the rows committed since each request's last tree, run first in the same call as a
    chain past its committed length and committed to ``cache`` after it; the roots come from
    their last rows (``roots`` is then (None, None)) and the levels run past them. Returns
    (tokens, parents, depths [B * n] and the mask [B * n, W]; n = num_nodes + 1) and the
    catch-up's seconds (0 without one)."""
    slots, root_tokens = requests
    top_k, depth, _ = shape
    levels = max(depth - 1, 1)
    counts = [0] * len(slots) if catch_up is None else list(catch_up[2])
    if catch_up is not None:
        tokens, features = catch_up[0], catch_up[1]
        if len(counts) != len(slots) or min(counts, default=1) < 1 or sum(counts) != len(tokens):
            raise ValueError(f"a catch-up needs one count >= 1 per request summing to its {len(tokens)} tokens, "
                             f"got {counts} for {len(slots)} requests")  # fmt: skip
        if features is not None and features.shape[0] != len(tokens):
            raise ValueError(
                f"a catch-up's features need one row per token ({len(tokens)}), got {features.shape[0]}"
            )
    for slot, count in zip(slots, counts, strict=True):
        cache.check_room(slot, count + (depth - 1) * top_k)
    committed = torch.tensor([cache.lengths[s] for s in slots], dtype=torch.long)
    ahead = torch.tensor(counts, dtype=torch.long)
    if rotary.static:  # the whole table: request b's catch-up row j reads row committed + j, level s committed + count + s - 1
        cos, sin = rotary.covering(int((committed + ahead).max()) + levels)
        catch_row, first_row = committed, committed + ahead
    else:  # this call's rows only: per request its catch-up rows, then its levels
        positions = torch.cat(
            [torch.arange(c, c + n + levels) for c, n in zip(committed.tolist(), counts, strict=True)]
        )
        cos, sin = rotary_tables(rotary.rotary, torch.empty(len(positions), 0, dtype=rotary.dtype), positions,
                                 rotary.head_dim)  # fmt: skip
        catch_row = torch.cumsum(ahead + levels, 0) - ahead - levels
        first_row = catch_row + ahead
    root_h, root_logits = (None if t is None else t.contiguous() for t in roots)
    rows = (torch.tensor(slots, dtype=torch.long), committed, first_row, torch.tensor(root_tokens, dtype=torch.long),
            root_h, root_logits)  # fmt: skip
    caught = None
    if catch_up is not None:
        features = None if catch_up[1] is None else catch_up[1].contiguous()
        caught = (torch.tensor(catch_up[0], dtype=torch.long), features, ahead, catch_row)
    flat, seconds = cpu_kernels.draft_tree_bf16(stack, readout, cos, sin, cache.keys, cache.values, rows, shape,
                                                caught)  # fmt: skip
    if catch_up is not None:
        cache.commit(slots, [range(n) for n in counts])
    return flat, seconds


def run_stack(
    hidden: torch.Tensor,
    table: ctypes.Array,
    final_norm: torch.Tensor | None,
    num_layers: int,
    dims: tuple[int, int, int, int, int],
    eps: float,
    sm_scale: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: object,
    rows: tuple[torch.Tensor, ...],
    tree_mask: torch.Tensor | None,
    outs: ctypes.Array,
    embeds: torch.Tensor | None = None,
) -> None:
    """``treespec_decoder_bf16`` over ``hidden`` [T, H] in place: ``dims`` (hidden, MLP width,
    query heads, KV heads, head dim), ``rows`` as :func:`treespec.kernels.tree_attention.cpu_rows`
    gives them, ``tree_mask`` [T, W] or None (chains), ``embeds`` [T, H] the rows' embeddings
    (an EAGLE-3 layer's) or None."""
    mask = None if tree_mask is None else tree_mask.to(torch.int32).contiguous()
    row_slot, row_prefix, row_index, row_new = (r.contiguous() for r in rows)
    keys, values = cache.keys, cache.values
    cpu_kernels.decoder_bf16(
        hidden, table, final_norm, num_layers, len(hidden), *dims, eps, sm_scale, cos, sin, keys, values,
        keys.shape[1], keys.shape[3], row_slot, row_prefix, row_index, row_new, mask,
        0 if mask is None else mask.shape[1], outs, None if embeds is None else embeds.contiguous(),
    )  # fmt: skip


def level_rows(
    cache: object, slots: list[int], k: int, num_run: int
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The rows of one tree level run alone (a drafter's newest level): k new rows per request,
    the last k of ``num_run`` run past each slot's committed length so far (the earlier ones'
    K/V already written there). Returns (rows as ``run_stack`` reads them, each row's committed
    length); refuses a level that would write past the cache."""
    for slot in slots:
        cache.check_room(slot, num_run)
    committed = torch.tensor([cache.lengths[s] for s in slots]).repeat_interleave(k)
    index = torch.arange(num_run - k, num_run).repeat(len(slots))
    return (
        torch.tensor(slots).repeat_interleave(k),
        committed,
        index,
        torch.full_like(committed, num_run),
    ), committed


def describe_path(path: str, reason: str) -> str:
    """ "native tree", "fused", "modules", each with "(why)" where it is not the fastest path
    there could be: how ``treespec bench`` names what ran a model or drafter."""
    return f"{path} ({reason})" if reason else path


class FusedDecoder:
    """The decoder stack of one model as one C call. Holds pointers into the model's weights (or
    the road's copies of them, :class:`StackTable`): an in-place update or a replaced parameter
    is seen at the next forward; a replaced module is not (build a new Target)."""

    def __init__(self, model: nn.Module) -> None:
        if (reason := fused_refusal(model)) is not None:
            raise ValueError(f"the fused decoder cannot serve this model: {reason}")
        self.model = model
        config = model.config
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = float(config.rms_norm_eps)
        self.sm_scale = float(model.model.layers[0].self_attn.scaling)
        # (the module's parameter dict, the name) per table entry; {} for an empty slot
        self._owner_list = [
            ({} if module is None else module._parameters, name) for module, name in self._owners()
        ]
        self._stack = StackTable()
        self._current()
        self.rotary = RotaryTable(model.model.rotary_emb, self.head_dim)  # every step's rows, a tree's

    @property
    def lm_head(self) -> torch.Tensor:
        return self._lm_head

    def tree_stack(self) -> tuple:
        """This stack as :func:`draft_tree` reads a draft model's (no fc; every layer, the final
        norm), the pointer table current."""
        self._current()
        dims = (self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim)
        return (self.model.model.embed_tokens.weight, None, None, self._table, self.num_layers, self._final_norm,
                dims, self.eps, self.sm_scale)  # fmt: skip

    def _owners(self) -> list[tuple[nn.Module, str]]:
        """Where every tensor the C stack reads lives, in table order (module, parameter name),
        then the final norm and the LM head."""
        out: list[tuple[nn.Module, str]] = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out += [(layer.input_layernorm, "weight"), (attn.q_proj, "weight"), (attn.k_proj, "weight"),
                    (attn.v_proj, "weight"), (attn.o_proj, "weight"), (layer.post_attention_layernorm, "weight"),
                    (mlp.gate_proj, "weight"), (mlp.up_proj, "weight"), (mlp.down_proj, "weight"),
                    (attn.q_proj, "bias"), (attn.k_proj, "bias"), (attn.v_proj, "bias"), (None, "")]  # fmt: skip
        return [*out, (self.model.model.norm, "weight"), (self.model.get_output_embeddings(), "weight")]

    def _tensors(self) -> list[torch.Tensor | None]:
        """Every tensor the C stack reads, in table order: read from the modules' parameter dicts
        (one dict lookup each, not a chain of ``nn.Module.__getattr__``: it runs every step)."""
        return [parameters.get(name) for parameters, name in self._owner_list]

    def _current(self) -> None:
        """The pointer table current (:class:`StackTable`), the final norm and the LM head."""
        tensors = self._tensors()
        self._table = self._stack.current(tensors[:-2])
        self._final_norm, self._lm_head = tensors[-2], tensors[-1]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: object,
        rows: tuple[torch.Tensor, ...],
        tree_mask: torch.Tensor | None,
        logit_rows: torch.Tensor | None,
        hidden_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """One step: ``tokens`` [T] and their sequence ``positions`` [T]; ``rows`` what
        :func:`treespec.kernels.tree_attention.cpu_rows` gives for the step (cache row,
        committed length, index among its request's new tokens, that request's count; the K/V of
        row t go to position committed + index); ``tree_mask`` [T, W] int32 or None (chains).
        Returns (logits [R, V] fp32 of ``logit_rows`` (None: all), final normed hidden [T, H]
        bf16, {layer: [T, H]} for ``hidden_layers``: 0 the embeddings, i the residual stream
        after layer i, num_layers the final normed rows, as HF's ``hidden_states`` number them)."""
        self._current()
        model = self.model.model
        hidden = model.embed_tokens.weight[tokens]  # a new [T, H] tensor: the C stack works in it
        cos, sin = self.rotary(hidden, positions)  # the module's own rows, from a table where it can be
        layer_hidden: dict[int, torch.Tensor] = {}
        outs = (ctypes.c_void_p * self.num_layers)()
        for layer in hidden_layers:
            if not 0 <= layer <= self.num_layers:
                raise ValueError(f"hidden layers must lie in [0, {self.num_layers}], got {layer}")
            if layer == 0:
                layer_hidden[0] = hidden.clone()
            elif layer < self.num_layers:
                layer_hidden[layer] = torch.empty_like(hidden)
                outs[layer - 1] = layer_hidden[layer].data_ptr()
        dims = (self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim)
        run_stack(hidden, self._table, self._final_norm, self.num_layers, dims, self.eps, self.sm_scale, cos, sin,
                  cache, rows, tree_mask, outs)  # fmt: skip
        if self.num_layers in hidden_layers:
            layer_hidden[self.num_layers] = hidden
        picked = hidden if logit_rows is None else hidden[logit_rows]
        logits = cpu_kernels.linear_unchecked(picked, self._lm_head, None).float()
        return logits, hidden, layer_hidden


def eagle_refusal(head: nn.Module) -> str | None:
    """Why an EAGLE head's layer cannot run through the fused decoder here, or None when it can.
    The fused layer is a Llama decoder layer: EAGLE-1's without its input norm, EAGLE-3's over
    [RMSNorm(embedding); RMSNorm(feature)] with the feature as its residual."""
    if (reason := env_refusal()) is not None:
        return reason
    config = head.config
    weight = head.fc.weight
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return f"the fused decoder is for bf16 heads on a CPU; this one is {weight.dtype} on {weight.device}"
    if not cpu_kernels.available():
        return f"the fused decoder needs treespec's CPU kernels: {cpu_kernels.unavailable_reason()}"
    if config.hidden_act != "silu":
        return f"the fused decoder's MLP is SiLU-gated; this head's activation is {config.hidden_act!r}"
    if head.layer.self_attn.o_proj.bias is not None:
        return "the head's o-proj has a bias, which the fused decoder does not add"
    modules = (head.fc, head.layer, head.norm, head.lm_head) if config.eagle3 else (head.fc, head.layer)
    tensors = [p for m in modules for p in m.parameters()]
    if not all(p.dtype is torch.bfloat16 and p.is_contiguous() for p in tensors):
        return "the head has parameters that are not contiguous bf16"
    return None


class FusedEagleLayer:
    """An EAGLE head's pass as two C calls: ``fc``, then the decoder layer over the head's own KV
    cache, attention masked as the target's tree attention is. EAGLE-1: ``fc`` over [embedding;
    feature], a layer without input norm. EAGLE-3: ``fc`` fuses the target's three layers (only
    where the features are the target's), the layer reads [RMSNorm(embedding); RMSNorm(feature)]
    with the feature as its residual, and the read-out goes through the head's own norm first
    (:meth:`read_out`). The same arithmetic as the head's modules on the fused target path: bf16
    rounding wherever they round, RMSNorm summed in another order. Holds the head's weights (or the
    road's copies, :class:`StackTable`): an in-place update is seen at the next call, a replaced
    parameter is not (build a new one)."""

    def __init__(self, head: nn.Module) -> None:
        if (reason := eagle_refusal(head)) is not None:
            raise ValueError(f"the fused decoder cannot serve this EAGLE head: {reason}")
        config, layer = head.config, head.layer
        attn, mlp = layer.self_attn, layer.mlp
        self.head = head
        self.eagle3 = config.eagle3
        self.shape = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim)  # fmt: skip
        self.eps = float(config.rms_norm_eps)
        self.sm_scale = float(config.head_dim) ** -0.5
        self.fc = (head.fc.weight, head.fc.bias)
        self.feature_size = config.feature_size
        # EAGLE-3 reads out through its own norm (the layer's output stays the next feature)
        self.readout_norm = head.norm.weight if config.eagle3 else None
        norms = (layer.hidden_norm.weight, layer.input_layernorm.weight) if config.eagle3 else (None, None)
        self._slots = [norms[0], attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
                       layer.post_attention_layernorm.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                       mlp.down_proj.weight, attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, norms[1]]  # fmt: skip
        assert len(self._slots) == len(_SLOTS)
        self._stack = StackTable()
        self._no_outs = (ctypes.c_void_p * 1)()
        self.rotary = RotaryTable(head.rotary, config.head_dim)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        cache: object,
        rows: tuple[torch.Tensor, ...],
        tree_mask: torch.Tensor | None,
        from_target: bool = False,
    ) -> torch.Tensor:
        """``embeds`` [T, H] and ``features`` bf16: the head's own outputs [T, H], or with
        ``from_target`` the target's features [T, feature_size] (EAGLE-3: its three layers, fused
        by ``fc`` first); their sequence ``positions`` [T]; ``rows`` and ``tree_mask`` as
        :meth:`FusedDecoder.forward` takes them (a row's K/V go to position committed + index of
        its slot). Returns the head's outputs h [T, H] bf16 (EAGLE-3: before its norm)."""
        width = self.feature_size if from_target else self.shape[0]
        if features.shape[-1] != width:
            raise ValueError(f"expected features of width {width}, got {features.shape[-1]}")
        if not self.eagle3:
            x = cpu_kernels.linear_unchecked(torch.cat([embeds, features], dim=-1), *self.fc)
        elif from_target:
            x = cpu_kernels.linear_unchecked(features, *self.fc)
        else:
            x = features.clone()  # the C stack works in place: the caller's features stay
        cos, sin = self.rotary(x, positions)
        run_stack(x, self._stack.current(self._slots), None, 1, self.shape, self.eps, self.sm_scale, cos, sin, cache,
                  rows, tree_mask, self._no_outs, embeds if self.eagle3 else None)  # fmt: skip
        return x

    def read_out(self, h: torch.Tensor, readout: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, V] of the head's outputs h [T, H] through ``readout`` [V, H] (EAGLE-3:
        after its norm, the C stack's RMSNorm, as the one-call tree reads out)."""
        if self.readout_norm is not None:
            h = cpu_kernels.rmsnorm_unchecked(h, self.readout_norm, self.eps)
        return cpu_kernels.linear_unchecked(h, readout, None, fp32_out=True)

    def draft_tree(
        self,
        embed: torch.Tensor,
        readout: torch.Tensor,
        column_ids: torch.Tensor | None,
        cache: object,
        requests: tuple[list[int], list[int]],
        root_h: torch.Tensor | None,
        shape: tuple[int, int, int],
        catch_up: tuple[list[int], torch.Tensor, list[int]] | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], float]:
        """An EAGLE-2 tree per request in one C call (:func:`draft_tree`): every level's pass as
        :meth:`forward` computes it, then the read-out as :meth:`read_out` computes it through
        ``readout`` [V, H] (columns' tokens ``column_ids``, None: column c is token c). ``embed``
        the target's input embeddings, ``requests`` their (head cache slots, root tokens),
        ``root_h`` [B, H] the head's outputs at the roots, read out inside; or None with
        ``catch_up`` (tokens, target features [C, feature_size], counts): the pairs committed
        since the last tree, run first in the same call (:func:`draft_tree`)."""
        if catch_up is not None and catch_up[1].shape[-1] != self.feature_size:
            raise ValueError(
                f"a catch-up's features need width {self.feature_size}, got {catch_up[1].shape[-1]}"
            )
        stack = (
            embed,
            *self.fc,
            self._stack.current(self._slots),
            1,
            None,
            self.shape,
            self.eps,
            self.sm_scale,
        )
        return draft_tree(stack, self.rotary, (readout, column_ids, self.readout_norm), cache, requests,
                          (root_h, None), shape, catch_up)  # fmt: skip
