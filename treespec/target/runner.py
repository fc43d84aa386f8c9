"""The target: an unmodified Hugging Face causal LM run as one flattened, ragged forward.

treespec registers its attention function under the name ``"treespec"`` in transformers'
attention-function registry. The user's model is left as it was found: the :class:`Target` runs
a *view* of it (new module objects over the same weight tensors, with their own copy of the
config naming treespec's attention, and with the CPU linear backend of :mod:`treespec.target.linear`),
which goes when the Target goes. The per-step metadata (:class:`StepMetadata`: cache, slots,
lengths, bitmask) travels as the keyword argument ``treespec_step`` of the view's forward, which
transformers hands unchanged to every attention call. Nothing is set on any module per step.

All requests of a step go through the model as one sequence (batch dimension 1) with explicit
position ids: positions are ``prefix_len + depth``; the K/V of new token i of request b are
written to cache position ``prefix_lens[b] + i`` before attention.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from treespec.kernels import cpu_kernels
from treespec.kernels.tree_attention import (
    AttentionPlan,
    TritonSchedule,
    attend,
    build_plan,
    cpu_rows,
    resolve_backend,
    schedule_blocks,
    tree_attention_cpu,
    tree_attention_triton,
    triton_layout_refusal,
)
from treespec.target import linear
from treespec.target.cache import KVCache
from treespec.target.fused import FusedDecoder, env_refusal, fused_refusal, say_once

ATTENTION_NAME = "treespec"
STEP_KWARG = "treespec_step"


@dataclass
class StepMetadata:
    """What every attention layer needs for one step. Built once per step, read by all layers.

    The host knows a step's layout before it runs (how many new tokens each request has, its
    cache row and committed length), so the metadata is built from host lists and reaches the
    device in one copy, and nothing here reads the device (docs/architecture.md).

    Shapes (B requests in the step, T new tokens in all):
        cu_q        [B+1] int32   request b owns rows cu_q[b]:cu_q[b+1]
        slots       [B] int32     cache row of each request
        prefix_lens [B] int32     committed tokens of each request
        tree_mask   [T, W] int32  ancestor bitmask, or None for causal chains
        q_positions [T] int32     sequence position of each new token
        row_slots   [T] long      cache row each new token's K/V is written to
        row_pos     [T] long      cache position each new token's K/V is written to
        num_new, prefix, slot_list   the host's copies: [B] ints each
    """

    cache: KVCache
    cu_q: torch.Tensor
    slots: torch.Tensor
    prefix_lens: torch.Tensor
    tree_mask: torch.Tensor | None
    q_positions: torch.Tensor
    row_slots: torch.Tensor
    row_pos: torch.Tensor
    num_new: list[int]
    prefix: list[int]
    slot_list: list[int]
    backend: str = "reference"  # "reference", "triton" or "cpu", resolved by the Target
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def num_rows(self) -> int:
        return sum(self.num_new)

    def plan(self, window: int | None) -> AttentionPlan:
        """The attention plan for this step, built once per distinct sliding window."""
        if window not in self._plans:
            self._plans[window] = build_plan(
                self.cu_q, self.slots, self.prefix_lens, self.tree_mask, window=window,
                q_positions=self.q_positions, host=(self.num_new, self.prefix, self.slot_list),
            )  # fmt: skip
        return self._plans[window]

    def schedule(self, group: int) -> TritonSchedule:
        """The Triton kernel's block schedule for this step, built once per GQA group size."""
        key = ("triton", group)
        if key not in self._plans:
            longest_prefix = max(self.prefix, default=0)
            self._plans[key] = schedule_blocks(self.num_new, longest_prefix, group, device=self.cu_q.device)
        return self._plans[key]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V [T, Hkv, D] of every new token at its row's cache position."""
        if len(self.slot_list) == 1:
            self.cache.write_run(layer, self.slot_list[0], self.prefix[0], k, v)
        else:
            self.cache.write(layer, self.row_slots, self.row_pos, k, v)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        *,
        sm_scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Tree attention of the new tokens' queries q [T, Hq, D] over layer ``layer`` of the cache."""
        k_cache, v_cache = self.cache.keys[layer], self.cache.values[layer]
        if self.backend == "triton":
            return tree_attention_triton(
                q.contiguous(), k_cache, v_cache, self.cu_q, self.slots, self.prefix_lens, self.tree_mask,
                sm_scale=sm_scale, window=window, softcap=softcap, q_positions=self.q_positions,
                schedule=self.schedule(q.shape[1] // k_cache.shape[1]),
            )  # fmt: skip
        if self.backend == "cpu":
            if "cpu" not in self._plans:
                self._plans["cpu"] = cpu_rows(self.cu_q, self.slots, self.prefix_lens, self.num_rows)
            return tree_attention_cpu(
                q, k_cache, v_cache, self.cu_q, self.slots, self.prefix_lens, self.tree_mask, sm_scale=sm_scale,
                window=window, softcap=softcap, q_positions=self.q_positions, rows=self._plans["cpu"],
            )  # fmt: skip
        return attend(q, k_cache, v_cache, self.plan(window), sm_scale=sm_scale, softcap=softcap)

    @classmethod
    def build(
        cls,
        cache: KVCache,
        num_new: Sequence[int],
        slots: Sequence[int],
        tree_mask: torch.Tensor | None = None,
        depth: torch.Tensor | None = None,
        *,
        backend: str = "reference",
    ) -> StepMetadata:
        """Metadata for ``num_new[b]`` new tokens on top of each slot's committed prefix.

        New token i of request b is written at ``prefix_lens[b] + i`` and sits at sequence position
        ``prefix_lens[b] + depth[i]`` (``depth`` None: ``i``, i.e. chains). Checks room first.
        ``num_new`` and ``slots`` are host ints; the committed lengths are the cache's host list.
        Everything is laid out on the host and copied to the device once.
        """
        num_new, slot_list = [int(n) for n in num_new], [int(s) for s in slots]
        if len(num_new) != len(slot_list) or any(n < 0 for n in num_new):
            raise ValueError(
                f"need one count >= 0 of new tokens per slot, got {num_new} for slots {slot_list}"
            )
        for slot, n in zip(slot_list, num_new, strict=True):
            cache.check_room(slot, n)  # before any compute
        prefix = [cache.lengths[s] for s in slot_list]
        batch, num_rows = len(num_new), sum(num_new)
        counts = torch.tensor(num_new, dtype=torch.long)
        cu = torch.zeros(batch + 1, dtype=torch.long)
        torch.cumsum(counts, 0, out=cu[1:])
        row_request = torch.repeat_interleave(torch.arange(batch), counts, output_size=num_rows)
        row_index = torch.arange(num_rows) - cu[:-1][row_request]
        slot_t, prefix_t = torch.tensor(slot_list, dtype=torch.long), torch.tensor(prefix, dtype=torch.long)
        row_prefix = prefix_t[row_request]
        host = torch.cat([cu, slot_t, prefix_t, slot_t[row_request], row_prefix, row_prefix + row_index])
        device = cache.keys.device
        on_device = host.to(device)  # the step's one host-to-device copy
        cu_q, slots_d, prefix_d, row_slots, row_prefix_d, row_pos = on_device.split(
            [batch + 1, batch, batch, num_rows, num_rows, num_rows]
        )
        q_positions = row_pos if depth is None else row_prefix_d + depth.to(device).long()
        return cls(
            cache=cache,
            cu_q=cu_q.to(torch.int32),
            slots=slots_d.to(torch.int32),
            prefix_lens=prefix_d.to(torch.int32),
            tree_mask=None if tree_mask is None else tree_mask.to(device),
            q_positions=q_positions.to(torch.int32),
            row_slots=row_slots,
            row_pos=row_pos,
            num_new=num_new,
            prefix=prefix,
            slot_list=slot_list,
            backend=backend,
        )


def host_rows(
    cache: KVCache, num_new: Sequence[int], slots: Sequence[int], depth: torch.Tensor | None = None
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """What the fused CPU path reads of a step, laid out from host lists in one tensor: the rows
    :func:`treespec.kernels.tree_attention.cpu_rows` gives (cache slot, committed length, index
    among its request's new tokens, that request's count; [T] int64 each) and the rows' sequence
    positions (committed length + ``depth``, or + index for chains). The checks of
    :meth:`StepMetadata.build`, without its torch operators (a few hundred microseconds a step
    on the CPU)."""
    num_new, slot_list = [int(n) for n in num_new], [int(s) for s in slots]
    if len(num_new) != len(slot_list) or any(n < 0 for n in num_new):
        raise ValueError(f"need one count >= 0 of new tokens per slot, got {num_new} for slots {slot_list}")
    row_slot, row_prefix, row_index, row_new = [], [], [], []
    for slot, n in zip(slot_list, num_new, strict=True):
        cache.check_room(slot, n)  # before any compute
        prefix = cache.lengths[slot]
        row_slot += [slot] * n
        row_prefix += [prefix] * n
        row_index += range(n)
        row_new += [n] * n
    table = torch.tensor([row_slot, row_prefix, row_index, row_new], dtype=torch.long).reshape(4, -1)
    positions = table[1] + (table[2] if depth is None else depth.long())
    return tuple(table), positions


def _treespec_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention hook: [1, H, T, D] in, ([1, T, Hq, D], None) out."""
    step: StepMetadata | None = kwargs.pop(STEP_KWARG, None)
    if step is None:  # not a treespec forward: behave exactly like the SDPA implementation
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    layer = module.layer_idx
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    step.write(layer, k, v)
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    softcap = kwargs.get("softcap")  # only models whose attention passes it use it (Gemma 2 does)
    sm_scale = scaling if scaling is not None else module.head_dim**-0.5
    out = step.attend(layer, query[0].transpose(0, 1), sm_scale=sm_scale, window=window, softcap=softcap)
    return out[None], None


AttentionInterface.register(ATTENTION_NAME, _treespec_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # used only by non-treespec calls


@dataclass
class TargetOutput:
    """One forward's results.

    Shapes:
        logits       [R, V]  float32, for the rows asked for (in that order)
        hidden       [T, H]  final normed hidden state of every row (None if not asked for)
        layer_hidden dict layer -> [T, H]: outputs of the chosen decoder layers (0 = embeddings)
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None
    layer_hidden: dict[int, torch.Tensor]


def _check_causal_lm(model: object) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if type(model).__name__ not in causal_classes or model.config.is_encoder_decoder:
        raise TypeError(
            f"{type(model).__name__} is not a decoder-only causal LM (expected e.g. LlamaForCausalLM, "
            "Qwen2ForCausalLM, Gemma3ForCausalLM)"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise TypeError(
            f"{type(model).__name__}'s attention does not go through transformers' attention registry"
        )
    config = model.config
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported: treespec attention is causal")
    attention = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    if not attention or not all(m.is_causal for m in attention):
        raise ValueError(
            f"{type(model).__name__} has non-causal attention layers; treespec needs causal self-attention"
        )
    for name in ("logits_scaling", "logit_scale"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"config.{name} is not supported by treespec's logits path")


def _treespec_view(model: PreTrainedModel, linear_backend: str) -> PreTrainedModel:
    """The model as treespec runs it, leaving ``model`` untouched: a module view sharing its
    weights (:func:`treespec.target.linear.module_view`), in eval mode, whose modules read a copy of the
    config that names treespec's attention function. Sub-configs (a text config inside a
    multimodal one) are copied with it, and every module of the view points at the copies."""
    view = linear.module_view(model, linear_backend)
    copies: dict[int, object] = {}
    config = copy.deepcopy(model.config, copies)  # copies: id(original object) -> its copy
    for module in view.modules():
        own = module.__dict__.get("config")
        if own is not None and id(own) in copies:
            module.config = copies[id(own)]
    view.config = config
    view.set_attn_implementation(ATTENTION_NAME)
    return view.eval()


def batch_invariance_refusal(model: PreTrainedModel) -> str | None:
    """Why this model cannot be scored batch-invariantly here, or None when it can: treespec's CPU
    kernels serve bf16 models on x86-64 CPUs with AVX2, without sliding windows or soft-capping."""
    if model.device.type != "cpu" or model.dtype != torch.bfloat16:
        return f"it needs a bf16 model on a CPU (treespec's CPU kernels); this one is {model.dtype} on {model.device}"
    if not cpu_kernels.available():
        return f"it needs treespec's CPU kernels: {cpu_kernels.unavailable_reason()}"
    config = model.config
    if getattr(config, "sliding_window", None) or getattr(config, "attn_logit_softcapping", None):
        return f"the CPU attention kernel has no sliding window or logit soft-capping, which {type(model).__name__} uses"
    return None


def _invariance_choice(
    batch_invariant: bool | None, attention_backend: str, linear_backend: str, refusal: str | None
) -> tuple[bool, str, str]:
    """(batch_invariant, attention backend, linear backend): None turns invariance on where it
    can be and both backends are "auto"; on, it takes the CPU kernels for both, and a model or
    forced backend that cannot have it is refused with the reason."""
    if batch_invariant is None:
        batch_invariant = attention_backend == "auto" and linear_backend == "auto" and refusal is None
    if not batch_invariant:
        return False, attention_backend, linear_backend
    if refusal is not None:
        raise ValueError(f"batch_invariant=True: {refusal}")
    if attention_backend not in ("auto", "cpu") or linear_backend not in ("auto", "bf16-kernel"):
        raise ValueError(
            "batch_invariant=True takes attention 'cpu' and linear 'bf16-kernel'; got "
            f"attention_backend={attention_backend!r}, linear_backend={linear_backend!r}"
        )
    return True, "cpu", "bf16-kernel"


class Target:
    """A wrapped HF causal LM that scores flattened ragged batches of chains and trees."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        attention_backend: str = "auto",
        linear_backend: str = "auto",
        batch_invariant: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        """``attention_backend``: "auto" (Triton on CUDA, the PyTorch reference elsewhere),
        "triton", "reference" or "cpu"; a forced backend that cannot run here raises at once.
        ``linear_backend``: "auto" (on a CPU "bf16-kernel" for a bf16 model where treespec's
        kernel builds, else "fp32-kmajor"; "native" elsewhere), "native" (the model's own
        layers), "fp32-kmajor" or "bf16-kernel" (:mod:`treespec.target.linear`).

        ``batch_invariant``: score every row with the bits it would get alone, so that at T=0 a
        speculative run gives exactly the tokens of an autoregressive one in bf16 too (not only
        up to near-ties). It takes treespec's CPU kernels for the linear layers and the attention
        ("bf16-kernel", "cpu"): a bf16 model on an x86-64 CPU with AVX2, without sliding windows
        or soft-capping. None (the default): on wherever it can be and both backends are "auto"
        (it costs a single-token step nothing, see docs/architecture.md); True: required, and a
        model or backend that cannot have it is refused with the reason; False: off.

        ``fused``: run the decoder stack as one C call per step (:mod:`treespec.target.fused`), which
        takes batch invariance. None (the default): wherever it serves the model, else the
        modules, saying why once; True: required (refused with the reason); False: off.
        :attr:`path` names what runs."""
        _check_causal_lm(model)
        refusal = batch_invariance_refusal(model)
        batch_invariant, attention_backend, linear_backend = _invariance_choice(
            batch_invariant, attention_backend, linear_backend, refusal
        )
        if fused and not batch_invariant:
            raise ValueError("fused=True runs treespec's batch-invariant CPU kernels; batch_invariant is off")
        self.batch_invariant = batch_invariant
        self.attention_backend = resolve_backend(attention_backend, model.device)
        self.linear_backend = linear.resolve_linear_backend(linear_backend, model.device, model.dtype)
        self.model = model  # the user's model, left as it was found
        self.runner = _treespec_view(model, self.linear_backend)  # what treespec runs: shares the weights
        config = model.config
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layout = (config.num_attention_heads, self.num_kv_heads, self.head_dim, model.dtype)
        if self.attention_backend == "triton" and (layout_refusal := triton_layout_refusal(*layout)):
            raise ValueError(layout_refusal)
        self._no_mask = torch.zeros(1, 1, 0, 0, dtype=torch.bool, device=model.device)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = getattr(config, "max_position_embeddings", None)
        self._choose_path(fused, refusal)

    def _choose_path(self, fused: bool | None, invariance_refusal: str | None) -> None:
        """The fused decoder where it serves the model (and is not turned off), else the modules
        with the reason (said once when nobody asked)."""
        self.fused: FusedDecoder | None = None
        if fused is False:
            refusal = "fused=False"
        elif not self.batch_invariant:
            refusal = f"batch-invariant kernels are off ({invariance_refusal or 'batch_invariant=False or a forced backend'})"
        else:
            refusal = fused_refusal(self.model)
        if refusal is None:
            self.fused = FusedDecoder(self.model)
        elif fused:
            raise ValueError(f"fused=True: {refusal}")
        elif self.batch_invariant and fused is None and env_refusal() is None:
            say_once(
                f"treespec runs {type(self.model).__name__} through its modules, not the fused decoder: {refusal}"
            )
        self.path = "fused" if self.fused is not None else "modules"
        self.path_reason = "" if self.fused is not None else refusal

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """A cache shaped for this model. It may hold a little more than the model's context: a
        tree's nodes sit past the committed prefix until verification keeps one path (callers
        check prompt + max_new_tokens against the context)."""
        return KVCache(
            self.num_layers,
            num_slots,
            self.num_kv_heads,
            max_len,
            self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        cu_q: torch.Tensor | Sequence[int],
        slots: torch.Tensor | Sequence[int],
        tree_mask: torch.Tensor | None = None,
        depth: torch.Tensor | None = None,
        logit_rows: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
        return_hidden: bool = True,
    ) -> TargetOutput:
        """Score the new tokens of all requests in one pass.

        Shape:
            tokens [T] long; cu_q [B+1]; slots [B]; tree_mask [T, W] int32 or None (chains);
            depth [T] (tree depth of each token; None = index within its request, i.e. chains);
            logit_rows [R] (None = all rows)
        ``return_hidden=False`` (with no ``hidden_layers``) skips collecting hidden states.
        ``cu_q`` and ``slots`` are best given as host lists (the engine's loop does): as tensors
        they are read back first, one host sync.
        """
        device = self.device
        cu = cu_q.tolist() if isinstance(cu_q, torch.Tensor) else list(cu_q)
        slots = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        num_new = [end - start for start, end in zip(cu[:-1], cu[1:], strict=True)]
        if self.fused is not None:
            rows, q_positions = host_rows(cache, num_new, slots, depth)
            logits, hidden, layer_hidden = self.fused.forward(
                tokens, q_positions, cache, rows, tree_mask, logit_rows, hidden_layers
            )
            return TargetOutput(logits=logits, hidden=hidden, layer_hidden=layer_hidden)
        step = StepMetadata.build(cache, num_new, slots, tree_mask, depth, backend=self.attention_backend)
        q_positions = step.q_positions.long()
        out = self.runner(
            input_ids=tokens.to(device)[None],
            position_ids=q_positions[None],
            # A 4-D mask is taken as already built: transformers then builds none (treespec's
            # attention reads the step's metadata instead), which also spares its host syncs.
            attention_mask=self._no_mask,
            use_cache=False,
            output_hidden_states=return_hidden or bool(hidden_layers),
            logits_to_keep=torch.arange(len(tokens), device=device)
            if logit_rows is None
            else logit_rows.to(device),
            **{STEP_KWARG: step},
        )
        states = out.hidden_states  # (embeddings, layer 1, ..., final normed) or None
        return TargetOutput(
            logits=out.logits[0].float(),
            hidden=None if states is None else states[-1][0],
            layer_hidden={layer: states[layer][0] for layer in hidden_layers},
        )
