"""Training EAGLE heads, Medusa heads and draft models on self-distilled data (``data``).

Losses (per position t of a sequence x_0 .. x_{n-1} with the target's final hidden states h and
its distribution p_t = softmax(lm_head(h_t)) over x_{t+1}):

- ``eagle`` (EAGLE-1): the head reads pairs (h_t + noise, x_{t+1}) and outputs o_t; loss =
  SmoothL1(o_t, h_{t+1}) + w * CE(lm_head(o_t), p_{t+1}) (the EAGLE paper's feature
  regression plus token cross-entropy against the target's distribution, ``token_weight`` w =
  0.1 as the paper). With a draft vocabulary (``draft_vocab_size``) the CE runs over those rows
  of the LM head, as inference does.
- both EAGLE kinds, with ``ttt_steps`` > 1: EAGLE-3's training-time test, the head run again on
  its own outputs (:class:`UnrolledAttention`), each step's loss weighted ``ttt_decay**step``.
- ``eagle3``: pairs (three-layer features, x_{t+1}); loss = CE of the head's draft-vocabulary
  read-out against p_{t+1} restricted to the draft vocabulary (the ``draft_vocab_size`` tokens the
  target produces most often in the data) and renormalised.
- ``medusa``: head i reads h_t and is trained with CE against p_{t+i+1}, the target's
  distribution of x_{t+i+2} (offsets 2, 3, ...; Medusa-2's self-distillation), on the positions
  whose x_{t+2} is generated, weighted 0.8^i.
- ``draft``: the target's first layers (heads/draft.py) trained with CE against p_t at every
  position (distillation on the target's distribution).
- ``loss_on``: "all" positions (the prompts' included), or "answers": only the positions whose
  predicted token the target generated (EAGLE: x_{t+2}; draft: x_{t+1}). Medusa always trains
  on the answers.
- Medusa and draft read out through ``draft_vocab_size`` rows of the LM head, as ``treespec
  bench`` drafts with them: the teacher's distribution is renormalised over them. The rows are
  the first ids (the frequent ones of a BPE vocabulary), or with ``readout="frequent"`` (draft
  models) the tokens the data holds most often, which the draft then carries (``readout_ids``).

AdamW, linear warm-up (``warmup_steps``, or ``warmup_ratio`` of the run) then cosine decay to
10 %, gradient clipping, a checkpoint after every epoch (and every ``checkpoint_every`` steps)
that ``resume`` continues from exactly (model, optimiser, schedule, data order), tau through the real engine at T=0 on the dev prompts after
each epoch, and a JSON report. Under ``torchrun`` it trains with DDP (gloo), each rank taking
every world-th batch; rank 0 writes and evaluates.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import PreTrainedModel

from treespec.api import generate
from treespec.heads.draft import make_draft, readout_ids, save_draft, set_readout_ids
from treespec.heads.eagle import EagleConfig, EagleHead
from treespec.heads.medusa import MedusaConfig, MedusaHeads
from treespec.heads.training.data import HeadDataset, Sequence
from treespec.presets import DRAFT_TREE, DRAFT_VOCAB, EAGLE_TREE, MEDUSA_TREE
from treespec.proposers import DraftModelProposer, EagleProposer, MedusaProposer

KINDS = ("eagle", "eagle3", "medusa", "draft")
PRECISIONS = ("fp32", "bf16")
LOSS_ON = ("all", "answers")
READOUTS = ("first", "frequent")
# TrainConfig fields a resumed run may change: they do not change what is learnt
RESUMABLE_CHANGES = frozenset({"checkpoint_every", "eval_prompts", "eval_new_tokens"})
CHECKPOINT = "checkpoint.pt"


@dataclass
class TrainConfig:
    kind: str
    epochs: int = 2
    lr: float = 1e-3
    warmup_steps: int = 20
    warmup_ratio: float | None = None  # warm-up as a fraction of the run's steps (overrides warmup_steps)
    batch_tokens: int = 2048
    max_seq_len: int = 512
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    feature_noise: float = 0.1  # EAGLE-1: uniform noise on the input features, +-this
    token_weight: float = 0.1  # EAGLE-1: the token loss's weight against the feature loss
    loss_on: str = "all"  # "all" positions, or the "answers" only (EAGLE kinds, draft)
    # EAGLE-3's training-time test: the head also runs on its own outputs, this many steps in all
    # (1: only on the target's features), each step's loss weighted ttt_decay**step
    ttt_steps: int = 1
    ttt_decay: float = 0.8
    medusa_heads: int = 3
    medusa_conditioned: bool = False  # Medusa: each head also reads the tokens before its guess (Hydra)
    draft_layers: int = 2
    draft_vocab_size: int = (
        DRAFT_VOCAB  # read-out rows (0: all): EAGLE, the most frequent tokens; else as ``readout``
    )
    # draft models: their read-out rows are the "first" ids, or the data's most "frequent" tokens
    # (stored with the draft); Medusa heads take the first ids
    readout: str = "first"
    checkpoint_every: int = 0  # steps; 0: only at the end of each epoch
    # "bf16": forwards and backwards under bf16 autocast (weights, gradients and AdamW state stay
    # fp32), several times faster on CPUs with bf16 matrix units; "fp32": every op in fp32
    precision: str = "fp32"
    eval_new_tokens: int = 128
    eval_prompts: int = 8
    seed: int = 0
    # train on a subset: whole sequences, in an order fixed by their tokens, until this many
    # answer tokens (None: all). Within one data folder a smaller subset opens a larger one.
    data_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.ttt_steps, int) or self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be an int >= 1, got {self.ttt_steps!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.data_tokens is not None and (not isinstance(self.data_tokens, int) or self.data_tokens < 1):
            raise ValueError(f"data_tokens must be a positive int or None, got {self.data_tokens!r}")
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {LOSS_ON}, got {self.loss_on!r}")
        if self.readout not in READOUTS:
            raise ValueError(f"readout must be one of {READOUTS}, got {self.readout!r}")
        if self.readout != "first" and self.kind != "draft":
            raise ValueError(
                f"readout {self.readout!r} is for draft models (EAGLE heads always read out through the data's "
                f"most frequent tokens, Medusa heads through the first ids); got kind {self.kind!r}"
            )
        if self.warmup_ratio is not None and not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1) or None, got {self.warmup_ratio!r}")
        for name in ("feature_noise", "token_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    def warmup(self, total_steps: int) -> int:
        """Warm-up steps of a run of ``total_steps``: ``warmup_ratio`` of them where set."""
        if self.warmup_ratio is None:
            return self.warmup_steps
        return max(1, round(self.warmup_ratio * total_steps))


# --------------------------------------------------------------------------------------------
# The module each kind trains
# --------------------------------------------------------------------------------------------


def build_module(
    config: TrainConfig, target: PreTrainedModel, data: HeadDataset, sequences: list[Sequence] | None = None
) -> nn.Module:
    """The module to train; an EAGLE draft vocabulary comes from ``sequences`` (default: all data)."""
    torch.manual_seed(config.seed)
    if config.kind in ("eagle", "eagle3"):
        vocab = target.get_output_embeddings().weight.shape[0]
        draft_vocab = min(config.draft_vocab_size, vocab) if config.draft_vocab_size else None
        if draft_vocab == vocab:
            draft_vocab = None
        head = EagleHead(
            EagleConfig.from_target(
                target.config,
                eagle3=config.kind == "eagle3",
                feature_layers=data.feature_layers if config.kind == "eagle3" else None,
                draft_vocab_size=draft_vocab,
            )
        )
        for p in head.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        if draft_vocab is not None:
            ids = frequent_tokens(
                data if sequences is None else sequences, draft_vocab, head.config.vocab_size
            )
            head.d2t.copy_(ids - torch.arange(draft_vocab))
        return head
    if config.kind == "medusa":
        hidden = target.config.get_text_config().hidden_size
        return MedusaHeads(MedusaConfig(hidden, target.get_output_embeddings().weight.shape[0],
                                        num_heads=config.medusa_heads, num_layers=1, own_lm_head=False,
                                        conditioned=config.medusa_conditioned))  # fmt: skip
    draft = make_draft(target, config.draft_layers)
    draft.float()
    vocab, rows = target.get_output_embeddings().weight.shape[0], readout_size(config, target)
    if config.readout == "frequent" and rows < vocab:
        set_readout_ids(draft, frequent_tokens(data if sequences is None else sequences, rows, vocab))
    return draft


def token_counts(data: Iterable[Sequence], vocab_size: int) -> torch.Tensor:
    """[vocab_size] how often each token occurs in the data (prompts and answers)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in data:
        counts += torch.bincount(seq.tokens, minlength=vocab_size)
    return counts


def frequent_tokens(data: Iterable[Sequence], k: int, vocab_size: int) -> torch.Tensor:
    """The k tokens that occur most in the data, sorted by id: an EAGLE-3 draft vocabulary."""
    return token_counts(data, vocab_size).topk(k).indices.sort().values  # ties: torch.topk's order


def frequent_readout(head: EagleHead, data: Iterable[Sequence], rows: int) -> tuple[torch.Tensor, float]:
    """The ``rows`` target ids of an EAGLE head's read-out that the data holds most often, sorted
    (for :meth:`EagleHead.with_readout`), and the share of the data's tokens within the head's
    read-out that they cover."""
    own = head.target_ids().cpu()
    if not 1 <= rows < len(own):
        raise ValueError(f"rows must be in [1, {len(own) - 1}] (the head reads out {len(own)}), got {rows}")
    counts = token_counts(data, head.config.vocab_size)[own]
    top = counts.topk(rows).indices
    return own[top].sort().values, float(counts[top].sum() / counts.sum().clamp(min=1))


def token_subset(sequences: list[Sequence], answer_tokens: int) -> list[Sequence]:
    """Whole sequences, ordered by a hash of their tokens, until ``answer_tokens`` answer tokens.

    The order depends only on each sequence, not on how shards hold them, and the subsets of one
    data folder nest: the smaller is the opening of the larger (learning-curve points)."""

    def key(seq: Sequence) -> bytes:
        return hashlib.blake2b(seq.tokens.to(torch.int32).numpy().tobytes(), digest_size=8).digest()

    chosen, total = [], 0
    for seq in sorted(sequences, key=key):
        if total >= answer_tokens:
            break
        chosen.append(seq)
        total += len(seq.tokens) - seq.prompt_len
    if total < answer_tokens:
        raise ValueError(
            f"data_tokens={answer_tokens} but the data holds only {total} answer tokens; "
            "write more with 'treespec train-heads answers' and 'features', or ask for fewer"
        )
    return chosen


def trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------------
# Batches and losses
# --------------------------------------------------------------------------------------------


def make_batches(sequences: list[Sequence], config: TrainConfig, epoch: int) -> list[list[int]]:
    """Sequence indices per batch, shuffled per epoch (seeded), at most batch_tokens each."""
    order = list(range(len(sequences)))
    random.Random(config.seed * 1000 + epoch).shuffle(order)
    batches, current, size = [], [], 0
    for i in order:
        n = min(len(sequences[i].tokens), config.max_seq_len)
        if current and size + n > config.batch_tokens:
            batches.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        batches.append(current)
    return batches


def _flat(
    sequences: list[Sequence], max_len: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Per sequence (tokens, hidden, features, prompt_len), cut to max_len positions, in fp32."""
    return [(s.tokens[:max_len], s.hidden[:max_len].float(),
             None if s.features is None else s.features[:max_len].float(), s.prompt_len)
            for s in sequences]  # fmt: skip


def soft_ce(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    return -(target_probs * torch.log_softmax(logits.float(), -1)).sum(-1).mean()


class UnrolledAttention:
    """Attention for the training-time test over flat rows holding several sequences.

    Step 0 is the head on the target's features: causal within each sequence. At step k >= 1
    the input at position t is the head's own step-(k-1) output at t - 1, as a depth-(k+1) draft
    at inference, which attends to the context the target computed (step-0 keys at positions
    <= t - k) and to its own ancestors (the step-j key at position t - k + j, for j = 1..k). Each
    call is the next step; keys and values of earlier steps are kept.

    Sequences attend only within themselves, so each runs as one row of a padded batch
    [sequences, longest]: the cost grows with the sum of squared lengths, not with the square of
    the flat batch (7x less at 2,048 positions of ~300-token sequences)."""

    def __init__(self, lengths: list[int]) -> None:
        self.seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        self.pos = torch.cat([torch.arange(n) for n in lengths])
        self.shape = (len(lengths), max(lengths))
        self.keys: list[torch.Tensor] = []  # per step [B, Hkv, L, D]
        self.values: list[torch.Tensor] = []

    def mask(self, step: int) -> torch.Tensor:
        """Which keys a position attends to at ``step``: [L, (step + 1) L], the same in every
        sequence (a shorter one's padding lies after its last real position)."""
        pos = torch.arange(self.shape[1])
        parts = [pos[None, :] <= pos[:, None] - step]
        for j in range(1, step + 1):
            parts.append(pos[None, :] == pos[:, None] - step + j)
        return torch.cat(parts, dim=1)

    def valid(self, step: int) -> torch.Tensor:
        """Rows whose step-``step`` input exists (a position has ``step`` predecessors)."""
        return self.pos >= step

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, D] flat rows -> [B, H, L, D]."""
        out = x.new_zeros(*self.shape, *x.shape[1:])
        out[self.seq, self.pos] = x
        return out.transpose(1, 2)

    def __call__(self, q, k, v):
        step = len(self.keys)
        self.keys.append(self._padded(k))
        self.values.append(self._padded(v))
        keys, values = torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)
        mask = self.mask(step)
        mask = mask | ~mask.any(1, keepdim=True)  # rows with no input at this step: any finite output
        out = F.scaled_dot_product_attention(self._padded(q), keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)[self.seq, self.pos]  # [T, Hq, D]


def eagle_loss(
    head: EagleHead,
    target: PreTrainedModel,
    batch: list[Sequence],
    config: TrainConfig,
    stats: dict | None = None,
):
    """EAGLE's loss at each step of the training-time test (``config.ttt_steps``; 1 = EAGLE-1's
    and EAGLE-3's step-0 loss alone). With ``stats`` (a dict), it also counts per step, over the
    answer positions, how often the head's top token is the target's top token within the
    read-out (``stats["correct"][step]``, ``stats["count"][step]``): the held-out number
    :func:`dev_loss` reports beside the loss, comparable between losses."""
    lm_head, embed = target.get_output_embeddings(), target.get_input_embeddings()
    rows = _flat(batch, config.max_seq_len)
    lengths = [len(t) - 1 for t, *_ in rows]
    tokens = torch.cat([t[1:] for t, *_ in rows])  # x_{t+1}
    eagle3 = head.config.eagle3
    features = torch.cat([(f if eagle3 else h)[:-1] for t, h, f, _ in rows])
    next_hidden = torch.cat([h[1:] for t, h, f, _ in rows])  # h_{t+1}
    # row t predicts x_{t+2}: an answer token from t = prompt_len - 2 on
    answer = torch.cat([torch.arange(n) >= p - 2 for n, (*_, p) in zip(lengths, rows, strict=True)])
    if not eagle3 and config.feature_noise:
        features = features + (torch.rand_like(features) * 2 - 1) * config.feature_noise
    attention = UnrolledAttention(lengths)
    first = torch.tensor([0, *lengths[:-1]]).cumsum(0)  # each sequence's first row
    with torch.no_grad():
        embeds = embed(tokens).float()
        if eagle3 or head.config.draft_vocab_size is not None:  # the read-out's tokens, renormalised
            ids = head.target_ids()
            bias = None if lm_head.bias is None else lm_head.bias[ids]
            probs = torch.softmax(F.linear(next_hidden, lm_head.weight[ids], bias).float(), -1)
        else:
            probs = torch.softmax(lm_head(next_hidden).float(), -1)
    inputs = head.fuse(features)
    total, weights = 0.0, 0.0
    for step in range(config.ttt_steps):
        out = head(embeds, inputs, attention.pos, attention)
        keep = attention.valid(step)
        if config.loss_on == "answers":
            keep = keep & answer
        if not keep.any():
            break
        logits = head.logits(out[keep], lm_head)
        if eagle3:
            loss = soft_ce(logits, probs[keep])
        else:
            loss = F.smooth_l1_loss(out[keep], next_hidden[keep]) + config.token_weight * soft_ce(
                logits, probs[keep]
            )
        if stats is not None:  # on the answer positions only, whatever the loss reads
            scored = answer[keep]
            _count_top1(stats, step, logits[scored], probs[keep][scored])
        total = total + config.ttt_decay**step * loss
        weights += config.ttt_decay**step
        # The next step's input at position t is this step's output at t - 1 (same sequence).
        shifted = torch.roll(out, 1, dims=0)
        shifted[first] = 0.0
        inputs = shifted
    if not weights:  # no position to learn from in this batch (answers only, all prompt)
        return sum(p.sum() for p in trainable(head)) * 0
    return total / weights


def _count_top1(stats: dict, step: int, logits: torch.Tensor, probs: torch.Tensor) -> None:
    """Add to ``stats`` how many rows of a step (or head) have the target's top token on top."""
    correct, count = stats.setdefault("correct", []), stats.setdefault("count", [])
    while len(correct) <= step:
        correct.append(0)
        count.append(0)
    correct[step] += int((logits.argmax(-1) == probs.argmax(-1)).sum())
    count[step] += len(logits)


def medusa_loss(
    heads: MedusaHeads,
    target: PreTrainedModel,
    batch: list[Sequence],
    config: TrainConfig,
    stats: dict | None = None,
):
    """Self-distillation (Medusa-2): head i at position t learns the target's distribution of
    x_{t+i+2}, the softmax of its LM head at h_{t+i+1}, over the read-out's rows (renormalised),
    on the positions t whose x_{t+2} the target generated. Weight 0.8^i per head. Conditioned
    heads also read the embeddings of x_{t+1} .. x_{t+i+1}, the tokens the data holds (teacher
    forcing: the target generated them)."""
    readout = ReadoutRows(target.get_output_embeddings(), readout_size(config, target))
    num_heads = heads.config.num_heads
    conditioned = heads.config.conditioned
    rows, teacher_at, valid, hidden_all, before, offset = [], [], [], [], [], 0
    for tokens, hidden, _, prompt_len in _flat(batch, config.max_seq_len):
        n = len(tokens)
        first = max(prompt_len - 2, 0)  # the first t whose x_{t+2} is generated
        if n - 1 <= first:
            continue
        t = torch.arange(first, n - 1)
        rows.append(hidden[t])
        at = t[:, None] + 1 + torch.arange(num_heads)  # [rows, K]: the position whose state predicts
        valid.append(at <= n - 1)
        at = at.clamp(max=n - 1)
        before.append(tokens[at])  # [rows, K]: x_{t+1} .. x_{t+K}, head i reads i + 1 of them
        teacher_at.append(offset + at - (first + 1))  # the teacher reads from first + 1 on
        hidden_all.append(hidden[first + 1 :])
        offset += n - first - 1
    if not rows:
        return sum(p.sum() for p in trainable(heads)) * 0  # no answer position in this batch
    with torch.no_grad():
        teacher = torch.softmax(readout(torch.cat(hidden_all)).float(), -1)  # [positions, rows]
    embeds = target.get_input_embeddings()(torch.cat(before)).float() if conditioned else None
    logits = heads(torch.cat(rows), readout, embeds=embeds)  # [N, K, read-out rows]
    at, ok = torch.cat(teacher_at), torch.cat(valid)
    total, weights = logits.new_zeros(()), 0.0
    for i in range(num_heads):
        if ok[:, i].any():
            head_logits, head_teacher = logits[ok[:, i], i], teacher[at[ok[:, i], i]]
            total = total + 0.8**i * soft_ce(head_logits, head_teacher)
            weights += 0.8**i
            if stats is not None:  # every row here predicts an answer token
                _count_top1(stats, i, head_logits, head_teacher)
    return total / weights


def draft_loss(
    draft: PreTrainedModel,
    target: PreTrainedModel,
    batch: list[Sequence],
    config: TrainConfig,
    stats: dict | None = None,
):
    """Distillation: the draft's distribution at every position (the answers' only with
    ``loss_on="answers"``) against the target's, over the read-out's rows (renormalised).
    ``stats`` counts the top-1 agreement on the answer positions (one entry: a draft has one
    level, its own outputs being exact tokens)."""
    lm_head = target.get_output_embeddings()
    rows = _flat(batch, config.max_seq_len)
    width = max(len(t) for t, *_ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (tokens, *_rest) in enumerate(rows):
        ids[b, : len(tokens)], mask[b, : len(tokens)] = tokens, 1
    own = readout_ids(draft)
    readout = ReadoutRows(lm_head, readout_size(config, target) if own is None else own)
    # position t predicts x_{t+1}: an answer from prompt_len - 1 on
    prompt = torch.tensor([p for *_, p in rows])
    answers = mask.bool() & (torch.arange(width)[None, :] >= prompt[:, None] - 1)
    keep = answers if config.loss_on == "answers" else mask.bool()
    if not keep.any():
        return sum(p.sum() for p in trainable(draft)) * 0
    hidden = draft.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    logits = readout(hidden[keep])
    with torch.no_grad():  # the teacher at every real position, in the order hidden[mask] holds them
        teacher = torch.softmax(readout(torch.cat([h for _, h, _, _ in rows])).float(), -1)[keep[mask.bool()]]
    if stats is not None:
        scored = answers[keep]  # the kept positions that predict an answer token
        _count_top1(stats, 0, logits[scored], teacher[scored])
    return soft_ce(logits, teacher)


class ReadoutRows(nn.Module):
    """Rows of an LM head: the first ``rows`` (a view, no copy; as ``treespec bench
    --draft-vocab`` drafts Medusa heads and draft models), or the ids in a tensor (a draft model
    that carries its own read-out ids)."""

    def __init__(self, lm_head: nn.Module, rows: int | torch.Tensor) -> None:
        super().__init__()
        self.lm_head, self.rows = lm_head, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = slice(self.rows) if isinstance(self.rows, int) else self.rows
        bias = None if self.lm_head.bias is None else self.lm_head.bias[rows]
        return F.linear(x, self.lm_head.weight[rows], bias)


def readout_size(config: TrainConfig, target: PreTrainedModel) -> int:
    """Rows of the LM head the Medusa and draft losses read out through (``draft_vocab_size``,
    0: all); low token ids are the frequent ones in a BPE vocabulary."""
    vocab = target.get_output_embeddings().weight.shape[0]
    return min(config.draft_vocab_size, vocab) if config.draft_vocab_size else vocab


LOSSES = {"eagle": eagle_loss, "eagle3": eagle_loss, "medusa": medusa_loss, "draft": draft_loss}


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def lr_lambda(config: TrainConfig, total_steps: int):
    warmup = config.warmup(total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def train(
    config: TrainConfig,
    target: PreTrainedModel,
    data: HeadDataset,
    out_dir: str | Path,
    *,
    resume: bool = False,
    eval_prompts: list[list[int]] | None = None,
    dev: HeadDataset | None = None,
    max_steps: int | None = None,
    progress: bool = True,
) -> dict:
    """Train one kind; returns (and writes to out_dir/report.json) the report. With ``dev`` (held-out
    sequences of the same target: ``treespec train-heads features`` writes them to DATA/dev), each
    epoch's record also holds ``dev_loss`` (:func:`dev_loss`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if config.kind == "eagle3" and not data.has_features:
        raise ValueError(
            f"{data.folder} holds no EAGLE-3 features (three-layer inputs): write them with "
            "'treespec train-heads features --eagle3'"
        )
    target.requires_grad_(False)
    target.float()
    sequences = data.sequences()
    if config.data_tokens is not None:
        sequences = token_subset(sequences, config.data_tokens)
    loop = _Loop(config, target, sequences, build_module(config, target, data, sequences), out_dir)
    loop.dev = dev.sequences() if dev is not None else None
    if resume and (out_dir / CHECKPOINT).is_file():
        loop.resume()
    stopped = loop.run(eval_prompts, max_steps, progress)
    if loop.rank == 0 and stopped:
        loop.checkpoint()
    report = loop.report()
    if loop.rank == 0:
        save_module(config, loop.module, out_dir / "head")
        (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    return report


class _Loop:
    """One training run: the module, its optimizer and schedule, the plan of every epoch's
    batches, and the state a checkpoint keeps (step, epoch, batch within it, history, seconds
    trained by the runs this one resumes)."""

    def __init__(self, config: TrainConfig, target: PreTrainedModel, sequences: list[Sequence], module: nn.Module,
                 out_dir: Path) -> None:  # fmt: skip
        self.config, self.target, self.sequences, self.module, self.out_dir = (
            config,
            target,
            sequences,
            module,
            out_dir,
        )
        self.rank, self.world = _distributed()
        self.optimizer = torch.optim.AdamW(
            trainable(module), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
        )
        # Every epoch packs its own shuffled order, so epochs may differ by a batch: plan them all
        # up front (each rank the same number of batches) and keep the position within the epoch.
        self.plan = []
        for epoch in range(config.epochs):
            batches = make_batches(sequences, config, epoch)
            self.plan.append(batches[: len(batches) // self.world * self.world][self.rank :: self.world])
        if not self.plan or not self.plan[0]:
            raise ValueError(f"the data makes fewer batches than there are processes ({self.world})")
        self.total_steps = sum(len(b) for b in self.plan)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(config, self.total_steps)
        )
        # what the plan was made from: a resume on other data would index other batches
        self.planned = {"sequences": len(sequences), "positions": sum(len(s.tokens) for s in sequences),
                        "batch_tokens": config.batch_tokens, "max_seq_len": config.max_seq_len,
                        "epochs": config.epochs, "seed": config.seed, "world": self.world}  # fmt: skip
        self.recipe = {k: v for k, v in asdict(config).items() if k not in RESUMABLE_CHANGES}
        self.state = {"step": 0, "epoch": 0, "batch": 0, "history": [], "planned": self.planned,
                      "recipe": self.recipe}  # fmt: skip
        self.dev: list[Sequence] | None = None  # held-out sequences: each epoch's dev_loss
        self.start = time.perf_counter()
        self.before = 0.0  # seconds trained by the runs this one resumes

    def resume(self) -> None:
        path = self.out_dir / CHECKPOINT
        self.state = load_checkpoint(path, self.config, self.module, self.optimizer, self.scheduler)
        if self.state.get("planned", self.planned) != self.planned:
            raise ValueError(
                f"{path} was trained on other data or another plan ({self.state['planned']}); "
                f"this run has {self.planned}. Resume with the same data and options, or use a new --out folder"
            )
        saved = self.state.get("recipe", self.recipe)  # checkpoints before the recipe was kept: trusted
        # a setting added after the checkpoint was written ran at its default
        saved = {
            **{k: v for k, v in asdict(TrainConfig(self.config.kind)).items() if k in self.recipe},
            **saved,
        }
        differ = sorted(k for k in set(saved) | set(self.recipe) if saved.get(k) != self.recipe.get(k))
        if differ:
            changes = ", ".join(f"{k}: {saved.get(k)!r} -> {self.recipe.get(k)!r}" for k in differ)
            raise ValueError(
                f"{path} was trained with another configuration ({changes}); resume with the options it "
                "was started with, or use a new --out folder"
            )
        self.before = self.state.get("train_s", 0.0)

    def checkpoint(self) -> None:
        self.state["train_s"] = self.before + time.perf_counter() - self.start
        save_checkpoint(self.out_dir / CHECKPOINT, self.config, self.module, self.optimizer, self.scheduler,
                        self.state)  # fmt: skip

    def run(self, eval_prompts: list[list[int]] | None, max_steps: int | None, progress: bool) -> bool:
        """Every planned batch not trained yet, epoch by epoch; True when ``max_steps`` stopped it."""
        state = self.state
        self.bar = tqdm(total=self.total_steps, initial=state["step"], desc=f"train {self.config.kind}",
                        disable=not progress or self.rank)  # fmt: skip
        try:
            while state["epoch"] < self.config.epochs:
                losses = self._epoch(max_steps)
                if state["batch"] < len(self.plan[state["epoch"]]):
                    return True  # stopped inside the epoch: the checkpoint resumes at this batch
                self._end_epoch(losses, eval_prompts)
            return False
        finally:
            self.bar.close()

    def _epoch(self, max_steps: int | None) -> list[float]:
        """The current epoch's batches from where it stands; their losses."""
        state, batches, losses = self.state, self.plan[self.state["epoch"]], []
        self.module.train()
        while state["batch"] < len(batches):
            losses.append(self._step(batches[state["batch"]]))
            if (
                self.rank == 0
                and self.config.checkpoint_every
                and state["step"] % self.config.checkpoint_every == 0
            ):
                self.checkpoint()
            if max_steps is not None and state["step"] >= max_steps:
                break
        return losses

    def _step(self, batch: list[int]) -> float:
        with _autocast(self.config, self.target):
            loss = LOSSES[self.config.kind](
                self.module, self.target, [self.sequences[i] for i in batch], self.config
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.world > 1:
            _average_gradients(self.module, self.world)
        torch.nn.utils.clip_grad_norm_(trainable(self.module), self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.state["step"] += 1
        self.state["batch"] += 1
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{self.scheduler.get_last_lr()[0]:.2e}")
        return loss.item()

    def _end_epoch(self, losses: list[float], eval_prompts: list[list[int]] | None) -> None:
        state = self.state
        state["epoch"] += 1
        state["batch"] = 0
        record = {
            "epoch": state["epoch"],
            "steps": state["step"],
            "mean_loss": sum(losses) / max(len(losses), 1),
        }
        if self.rank == 0 and self.dev:
            record.update(dev_metrics(self.config, self.module, self.target, self.dev))
        if self.rank == 0 and eval_prompts:
            record.update(evaluate(self.config, self.module, self.target, eval_prompts))
        state["history"].append(record)
        if self.rank == 0:
            self.checkpoint()
            tqdm.write(json.dumps(record))

    def report(self) -> dict:
        # wall_s: every run's training time up to its last checkpoint, then this run's to the end
        # (a run cut between checkpoints redoes, and counts, the steps it lost)
        this_run = time.perf_counter() - self.start
        module, sequences = self.module, self.sequences
        return {"config": asdict(self.config), "steps": self.state["step"], "epochs_done": self.state["epoch"],
                "history": self.state["history"], "wall_s": self.before + this_run, "wall_s_this_run": this_run,
                "data_tokens": sum(len(s.tokens) for s in sequences), "data_sequences": len(sequences),
                "answer_tokens": sum(len(s.tokens) - s.prompt_len for s in sequences),
                "trainable_params": sum(p.numel() for p in trainable(module)),
                # equal on every rank of a data-parallel run (each step averages the gradients)
                "weights_checksum": float(sum(p.detach().double().sum() for p in trainable(module)))}  # fmt: skip


def save_module(config: TrainConfig, module: nn.Module, folder: Path) -> Path:
    if config.kind == "draft":
        return save_draft(module, folder)
    bf16 = type(module)(module.config)
    bf16.load_state_dict(module.state_dict())
    return bf16.to(torch.bfloat16).save(folder)


def _autocast(config: TrainConfig, target: PreTrainedModel) -> torch.autocast:
    return torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16")


def proposer_for(config: TrainConfig, module: nn.Module, target: PreTrainedModel):
    """The proposer tau is measured with: a dynamic tree of at most 32 nodes, root included."""
    if config.kind in ("eagle", "eagle3"):
        return EagleProposer(module, target, **EAGLE_TREE)  # as treespec bench drafts
    rows = readout_size(config, target)
    readout = range(rows) if rows < target.get_output_embeddings().weight.shape[0] else None
    if config.kind == "draft" and readout_ids(module) is not None:
        readout = None  # the draft reads out through its own ids
    if config.kind == "medusa":
        return MedusaProposer(module, target, **MEDUSA_TREE, readout_ids=readout)
    return DraftModelProposer(module, target_model=target, **DRAFT_TREE, readout_ids=readout)


@torch.inference_mode()
def evaluate(
    config: TrainConfig, module: nn.Module, target: PreTrainedModel, prompts: list[list[int]]
) -> dict:
    """Through the real engine, T=0, batch 1: ``tau`` (mean tokens per target step, the bonus
    included) and ``acceptance_by_depth`` (:func:`acceptance_by_depth`)."""
    module.eval()
    lengths = []
    for prompt in prompts[: config.eval_prompts]:
        out = generate(target, [prompt], max_new_tokens=config.eval_new_tokens,
                                proposer=proposer_for(config, module, target))  # fmt: skip
        lengths += out.stats.accepted_lengths[0]
    module.train()
    return {"tau": sum(lengths) / max(len(lengths), 1), "acceptance_by_depth": acceptance_by_depth(lengths)}


def dev_loss(
    config: TrainConfig, module: nn.Module, target: PreTrainedModel, sequences: list[Sequence]
) -> float:
    """The training loss on held-out sequences, the number whose floor says when training more
    stops paying: the same loss as training (its training-time test included) without the
    feature noise, no gradients, the module in eval mode; the batches' losses averaged weighted
    by their positions. Batches are packed as epoch 0 packs them, so the number is repeatable."""
    return dev_metrics(config, module, target, sequences)["dev_loss"]


def dev_metrics(
    config: TrainConfig, module: nn.Module, target: PreTrainedModel, sequences: list[Sequence]
) -> dict:
    """``dev_loss`` (:func:`dev_loss`) and ``dev_top1``: per step of the training-time test for
    EAGLE kinds (per head for Medusa, the tokens before its guess teacher-forced; one entry for a
    draft model), the share of held-out answer positions whose top drafted token is the target's
    top token within the read-out. The loss changes with the loss's settings
    (``token_weight``, ``loss_on``); ``dev_top1`` does not, so it compares recipes."""
    if not sequences:
        raise ValueError("dev_loss needs at least one held-out sequence, got none")
    quiet = replace(config, feature_noise=0.0)
    was_training = module.training
    module.eval()
    total, positions, stats = 0.0, 0, {}
    with torch.no_grad(), _autocast(config, target):
        for batch in make_batches(sequences, config, 0):
            chosen = [sequences[i] for i in batch]
            n = sum(len(s.tokens) for s in chosen)
            total += LOSSES[config.kind](module, target, chosen, quiet, stats=stats).item() * n
            positions += n
    module.train(was_training)
    metrics = {"dev_loss": total / positions}
    if stats:
        metrics["dev_top1"] = [c / max(n, 1) for c, n in zip(stats["correct"], stats["count"], strict=True)]
    return metrics


def expand_histogram(histogram: dict) -> list[int]:
    """``treespec bench``'s ``accepted_length_histogram`` ({length: count}, keys maybe strings
    after JSON) back to the list of tokens committed per step that :func:`acceptance_by_depth` reads."""
    return [int(length) for length, count in histogram.items() for _ in range(count)]


def acceptance_by_depth(lengths: list[int]) -> list[float]:
    """From the tokens committed per step (accepted drafts + 1): entry d is the share of steps
    whose depth-(d+1) draft was accepted among those that accepted depth d (depth 0: always)."""
    out = []
    depth = 1
    while True:
        reached = sum(1 for n in lengths if n >= depth)
        if not reached:
            break
        passed = sum(1 for n in lengths if n >= depth + 1)
        if not passed and depth > 1:
            break
        out.append(passed / reached)
        depth += 1
    return out


def save_checkpoint(path: Path, config, module, optimizer, scheduler, state) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"kind": config.kind, "state": state, "module": module.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state()}, tmp)  # fmt: skip
    os.replace(tmp, path)


def load_checkpoint(path: Path, config, module, optimizer, scheduler) -> dict:
    saved = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
    if saved["kind"] != config.kind:
        raise ValueError(
            f"{path} is a checkpoint of a {saved['kind']!r} run; this run trains {config.kind!r}"
        )
    module.load_state_dict(saved["module"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"])  # the feature noise continues as if never stopped
    return saved["state"]


def _average_gradients(module: nn.Module, world: int) -> None:
    """Data parallelism by hand: every rank ends the step with the mean gradient (gloo)."""
    import torch.distributed as dist

    for p in trainable(module):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= world


def _distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        return dist.get_rank(), world
    return 0, 1
