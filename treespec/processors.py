"""Logits processors on token trees: each row sees its own root-to-node path.

A processor that depends on the tokens so far (repetition, presence and frequency penalties,
``no_repeat_ngram_size``, multi-token ``bad_words_ids``, ``min_new_tokens``) must see, for a tree
node, the committed sequence followed by the drafted tokens on that node's own path, not the
whole tree: the node's logits predict the token after that path. The rows of one step are
described in the flattened ragged layout the engine already uses: row ``i`` belongs to request
``row_request[i]`` and its path is ``path_tokens[cu_path[i]:cu_path[i + 1]]`` (the tokens past
the committed sequence; a tree's root and a prompt's last row have empty paths). Counts are
scattered from that layout directly: no row is expanded to its whole context.

The processed logits replace the raw ones before verification (and before the first token is
drawn), so greedy verification takes the processed argmax and the rejection sampler accepts
against the processed distribution: speculation stays lossless with respect to the processed
target, which is what the target alone would sample.

Order and semantics follow Hugging Face's ``generate`` (its processors before its warpers):
``logit_bias`` (HF's ``sequence_bias`` for single tokens), ``repetition_penalty`` (over prompt
and output, as HF), then vLLM's ``frequency_penalty`` and ``presence_penalty`` (over the output
only, as vLLM and OpenAI define them), ``no_repeat_ngram_size``, ``bad_words_ids``,
``min_new_tokens``, ``suppress_tokens`` and ``begin_suppress_tokens``. Temperature, top-k, top-p
and min-p follow in ``treespec.sampling.logits_to_probs``. Logits are processed in float32, as HF
processes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treespec.sampling import SamplingParams


@dataclass(frozen=True)
class RowContexts:
    """Which request each logits row belongs to, and the tokens on its path.

    ``sequences[b]`` is request b's committed sequence (prompt then output), ``prompt_lens[b]``
    its prompt length, ``eos[b]`` its EOS ids. Row i extends ``sequences[row_request[i]]`` by
    ``paths[i]`` (host lists: the engine builds them from the trees it already holds on the host).
    """

    sequences: Sequence[Sequence[int]]
    prompt_lens: Sequence[int]
    params: Sequence[SamplingParams]
    eos: Sequence[frozenset[int]]
    row_request: Sequence[int]
    paths: Sequence[Sequence[int]]


def tree_paths(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """Per node of one tree (parents before children, node 0 the root), its path's tokens after
    the root."""
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):
        paths.append([] if i == 0 else paths[parent] + [tokens[i]])
    return paths


def process_draft(
    log_probs: torch.Tensor, requests: Sequence, row_request: Sequence[int], paths: Sequence[Sequence[int]]
) -> torch.Tensor:
    """A drafter's next-token log-probabilities [R, V] at tree nodes, with each node's request's
    processors applied on its path and renormalised (still log-probabilities, <= 0), so the drafter
    proposes what the processed target would more often. ``requests`` are the proposer's
    ``ProposalRequest``s. Only acceptance depends on this: verification judges by the target."""
    rows = RowContexts(
        [r.tokens for r in requests], [r.prompt_len for r in requests], [r.sampling for r in requests],
        [frozenset()] * len(requests), row_request, paths,
    )  # fmt: skip
    processed = process(log_probs, rows)
    if processed is log_probs:
        return log_probs
    return torch.log_softmax(processed, dim=-1).nan_to_num(nan=float("-inf"))  # a row banned whole stays -inf


def process(logits: torch.Tensor, rows: RowContexts) -> torch.Tensor:
    """The logits every row's request asks for, in float32 when any row is processed; the
    input itself when none is.

    Shape:
        logits [N, V] -> [N, V]
    """
    active = [i for i, b in enumerate(rows.row_request) if rows.params[b].has_processors]
    if not active:
        return logits
    out = logits.float().clone()
    index = torch.tensor(active, device=logits.device)
    out[index] = _process_rows(out[index], rows, active)
    return out


def _process_rows(scores: torch.Tensor, rows: RowContexts, active: list[int]) -> torch.Tensor:
    requests = [rows.row_request[i] for i in active]
    params = [rows.params[b] for b in requests]
    contexts = [
        _Context(rows.sequences[b], rows.prompt_lens[b], list(rows.paths[i]))
        for b, i in zip(requests, active, strict=True)
    ]
    _add_logit_bias(scores, params)
    _penalise(scores, params, contexts)
    banned = _bans(params, contexts, requests, rows.eos)
    if banned:
        r, t = zip(*banned, strict=True)
        scores[_long(r, scores.device), _long(t, scores.device)] = float("-inf")
    return scores


def _add_logit_bias(scores: torch.Tensor, params: list[SamplingParams]) -> None:
    bias = [(r, t, v) for r, p in enumerate(params) for t, v in p.logit_bias]
    if bias:
        r, t, v = zip(*bias, strict=True)
        device = scores.device
        scores.index_put_(
            (_long(r, device), _long(t, device)), torch.tensor(v, device=device), accumulate=True
        )


def _penalise(scores: torch.Tensor, params: list[SamplingParams], contexts: list[_Context]) -> None:
    """HF's repetition penalty (every token of prompt and output, once, whatever its count), then
    vLLM's frequency and presence penalties (the output's counts only), in vLLM's order."""
    device, vocab = scores.device, scores.shape[-1]
    penalised = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0]
    if penalised:
        seen = _counts(contexts, penalised, vocab, device, whole=True) > 0
        penalty = torch.tensor([params[r].repetition_penalty for r in penalised], device=device)[:, None]
        sub = scores[penalised]
        scores[penalised] = torch.where(seen, torch.where(sub < 0, sub * penalty, sub / penalty), sub)
    additive = [r for r, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if additive:
        counts = _counts(contexts, additive, vocab, device, whole=False)
        frequency = torch.tensor([params[r].frequency_penalty for r in additive], device=device)[:, None]
        presence = torch.tensor([params[r].presence_penalty for r in additive], device=device)[:, None]
        scores[additive] = scores[additive] - frequency * counts - presence * (counts > 0)


def _bans(
    params: list[SamplingParams], contexts: list[_Context], requests: list[int], eos_ids
) -> list[tuple[int, int]]:
    """(row, token) pairs no row may pick: repeated n-grams, bad words completed, EOS before
    min_new_tokens, suppressed tokens (at the first new token too, the begin-suppressed)."""
    banned: list[tuple[int, int]] = []
    tables: dict[int, dict] = {}  # per request: its committed sequence's n-grams, built once
    for r, (p, context) in enumerate(zip(params, contexts, strict=True)):
        if p.no_repeat_ngram_size:
            if requests[r] not in tables:
                tables[requests[r]] = ngrams(context.sequence, p.no_repeat_ngram_size)
            banned += [(r, t) for t in context.ngram_bans(p.no_repeat_ngram_size, tables[requests[r]])]
        eos = eos_ids[requests[r]]
        for word in p.bad_words_ids:
            if len(word) == 1 and word[0] in eos:
                continue  # HF drops single-token bad words that are an EOS id
            if context.ends_with(word[:-1]):
                banned.append((r, word[-1]))
        if context.new_tokens < p.min_new_tokens:
            banned += [(r, t) for t in eos]
        banned += [(r, t) for t in p.suppress_tokens]
        if context.new_tokens == 0:
            banned += [(r, t) for t in p.begin_suppress_tokens]
    return banned


def _long(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _counts(contexts: list[_Context], members: list[int], vocab: int, device, *, whole: bool) -> torch.Tensor:
    """[len(members), V] token counts of each member row's context: prompt, output and path
    (``whole``) or output and path. The committed part is counted once per request and added to
    its rows; the paths are scattered from their flat layout."""
    counts = torch.zeros(len(members), vocab, device=device)
    base: dict[int, torch.Tensor] = {}
    for k, r in enumerate(members):
        context = contexts[r]
        key = id(context.sequence)
        if key not in base:
            tokens = context.sequence if whole else context.sequence[context.prompt_len :]
            base[key] = torch.bincount(_long(list(tokens), device), minlength=vocab).float()
        counts[k] += base[key]
    flat = [(k, t) for k, r in enumerate(members) for t in contexts[r].path]
    if flat:
        k, t = zip(*flat, strict=True)
        counts.index_put_(
            (_long(k, device), _long(t, device)), torch.ones(len(flat), device=device), accumulate=True
        )
    return counts


class _Context:
    """One row's context, the committed sequence plus its path, read without concatenating."""

    def __init__(self, sequence: Sequence[int], prompt_len: int, path: list[int]) -> None:
        self.sequence, self.prompt_len, self.path = sequence, prompt_len, path

    @property
    def new_tokens(self) -> int:
        return len(self.sequence) - self.prompt_len + len(self.path)

    def tail(self, n: int) -> list[int]:
        """The last n tokens (all of them if the context is shorter)."""
        if n <= 0:
            return []
        if len(self.path) >= n:
            return self.path[-n:]
        return list(self.sequence[-(n - len(self.path)) :]) + self.path

    def ends_with(self, prefix: Sequence[int]) -> bool:
        return len(prefix) <= len(self.sequence) + len(self.path) and self.tail(len(prefix)) == list(prefix)

    def ngram_bans(self, n: int, committed: dict[tuple[int, ...], list[int]]) -> list[int]:
        """HF's ``no_repeat_ngram_size``: the tokens that would complete an n-gram already in the
        context (prompt included). ``committed``: the committed sequence's n-grams, prefix ->
        next tokens (``ngrams``); the ones ending on the path are added here."""
        if len(self.sequence) + len(self.path) + 1 < n:
            return []
        key = tuple(self.tail(n - 1))
        bans = list(committed.get(key, ()))
        joined = self.tail(n - 1 + len(self.path))  # the n-grams that end on the path
        for j in range(len(joined) - n + 1):
            if tuple(joined[j : j + n - 1]) == key:
                bans.append(joined[j + n - 1])
        return bans


def ngrams(tokens: Sequence[int], n: int) -> dict[tuple[int, ...], list[int]]:
    """Every n-gram of ``tokens``: its first n-1 tokens -> the tokens that followed them."""
    table: dict[tuple[int, ...], list[int]] = {}
    for i in range(len(tokens) - n + 1):
        table.setdefault(tuple(tokens[i : i + n - 1]), []).append(tokens[i + n - 1])
    return table
