"""Training text at scale, with no outside data: prompts the target writes itself, and its answers.

Two resumable stages, each an append-only JSON-lines file in one corpus folder:

1. :func:`synthesize_prompts` (``prompts.jsonl``): the Magpie method (arXiv 2406.08464). The
   target is given only its chat template's opening of a user turn and samples what follows; the
   text up to its end-of-turn token is a user prompt. Filters keep real questions (finished turns,
   a length range, mostly Latin letters, no template debris) and drop exact and near duplicates
   (MinHash over word 3-grams). Built-in prompts (``prompts.train_prompts``) and user files can be
   added with :func:`add_prompts`; :func:`synthesize_follow_ups` writes second turns (a follow-up
   question the target writes after one of its own answers), so the heads see long contexts.
2. :func:`write_answers` (``answers.jsonl``): the target answers every prompt through treespec's
   continuous-batching engine at large batch, mostly greedy, a share sampled (the share and the
   temperature are stored per answer). Each line holds the token ids the target read (chat
   template applied) and those it wrote, so features can be recomputed from them later at prefill
   speed without decoding again (``data.write_features``).

Every record has an ``id``; a killed stage resumes at the first record it did not finish (a
half-written last line is cut off). ``state.json`` holds what the Magpie stage needs to resume
(rounds done, each seeded by its index, and the filter counts).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from treespec.engine import Engine
from treespec.sampling import SamplingParams
from treespec.target import Target

PROMPTS = "prompts.jsonl"
ANSWERS = "answers.jsonl"
STATE = "state.json"
SENTINEL = "\x00TREESPEC_TURN\x00"

# Text that belongs to a chat template or a role header, not to a user's question.
_DEBRIS = re.compile(
    r"<\|[^>]*\|>|<\|im_|im_start|im_end|</?s>|^\s*(user|assistant|system)\s*[:\n]", re.I | re.M
)


# --------------------------------------------------------------------------------------------
# JSON-lines files that survive a kill
# --------------------------------------------------------------------------------------------


def read_records(path: Path) -> list[dict]:
    """The complete records of a JSON-lines file; a half-written last line is cut off the file."""
    if not path.is_file():
        return []
    raw = path.read_bytes()
    end = raw.rfind(b"\n") + 1
    if end < len(raw):
        with open(path, "r+b") as f:  # a kill mid-write: drop the partial line
            f.truncate(end)
    records = []
    for number, line in enumerate(raw[:end].splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path}, line {number}: not a JSON record ({exc.msg}); the file is corrupt"
            ) from None
    return records


def _append(path: Path, records: Iterable[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------


def template_prefix(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the chat template over ``messages`` followed by the opening of a new user
    turn, cut where the user's text would start (Magpie's pre-query template)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: a model that writes its own prompts needs one")
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": SENTINEL}], tokenize=False)
    if SENTINEL not in text:
        raise ValueError("the chat template does not place the user's text verbatim; cannot cut its opening")
    return tokenizer(text[: text.index(SENTINEL)], add_special_tokens=False)["input_ids"]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids the target reads for a conversation ending in a user turn (generation prompt on)."""
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def end_of_turn_ids(model: PreTrainedModel, tokenizer) -> list[int]:
    """Tokens that end a turn: the model's EOS ids and the template's end-of-turn marker."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    for text in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        token = tokenizer.convert_tokens_to_ids(text)
        if isinstance(token, int) and token != tokenizer.unk_token_id and token not in ids:
            ids.append(token)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


# --------------------------------------------------------------------------------------------
# Filters and near-duplicates
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptFilter:
    """What a written user turn must be to count as a prompt."""

    min_chars: int = 20
    max_chars: int = 1500
    min_words: int = 4
    min_latin_share: float = 0.85  # of its letters: this target writes English

    def reason_to_drop(self, text: str) -> str | None:
        """None when the text is kept, else a short reason (counted in state.json)."""
        if _DEBRIS.search(text):
            return "template debris"
        if len(text) < self.min_chars or len(text.split()) < self.min_words:
            return "too short"
        if len(text) > self.max_chars:
            return "too long"
        letters = [c for c in text if c.isalpha()]
        if not letters or sum(c.isascii() for c in letters) / len(letters) < self.min_latin_share:
            return "not English"
        words = text.lower().split()
        if len(set(words)) < 0.3 * len(words):
            return "repetitive"
        return None


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


class NearDuplicates:
    """MinHash with banded LSH over word 3-grams: ``add`` is False for a text whose estimated
    Jaccard similarity to one already added reaches ``threshold`` (or that equals one after
    normalisation)."""

    def __init__(self, threshold: float = 0.7, num_hashes: int = 64, bands: int = 16) -> None:
        if num_hashes % bands:
            raise ValueError(f"num_hashes ({num_hashes}) must be a multiple of bands ({bands})")
        self.threshold, self.num_hashes, self.rows = threshold, num_hashes, num_hashes // bands
        self.exact: set[str] = set()
        self.buckets: dict[tuple[int, bytes], list[int]] = {}
        self.signatures: list[torch.Tensor] = []
        self._salts = torch.arange(1, num_hashes + 1, dtype=torch.int64) * 0x9E3779B1

    def signature(self, text: str) -> torch.Tensor:
        words = normalise(text).split()
        grams = {" ".join(words[i : i + 3]) for i in range(max(len(words) - 2, 1))}
        base = torch.tensor(
            [int.from_bytes(hashlib.blake2b(g.encode(), digest_size=7).digest(), "little") for g in grams],
            dtype=torch.int64,
        )
        mixed = (base[:, None] ^ self._salts[None, :]) * 0x2545F4914F6CDD1D  # wraps: a fixed permutation
        return mixed.min(0).values

    def _bands(self, sig: torch.Tensor) -> list[tuple[int, bytes]]:
        return [
            (b, sig[b * self.rows : (b + 1) * self.rows].numpy().tobytes())
            for b in range(len(sig) // self.rows)
        ]

    def contains(self, text: str) -> bool:
        """Whether ``text`` equals (normalised) or nearly equals a text added before."""
        return normalise(text) in self.exact or self._near(self.signature(text))

    def _near(self, sig: torch.Tensor) -> bool:
        candidates = {i for band in self._bands(sig) for i in self.buckets.get(band, ())}
        return any((self.signatures[i] == sig).float().mean().item() >= self.threshold for i in candidates)

    def add(self, text: str) -> bool:
        """Add ``text`` unless it is a duplicate or near duplicate; returns whether it was added."""
        key = normalise(text)
        if key in self.exact:
            return False
        sig = self.signature(text)
        if self._near(sig):
            return False
        index = len(self.signatures)
        bands = self._bands(sig)
        self.exact.add(key)
        self.signatures.append(sig)
        for band in bands:
            self.buckets.setdefault(band, []).append(index)
        return True


# --------------------------------------------------------------------------------------------
# Stage 1: prompts
# --------------------------------------------------------------------------------------------


@dataclass
class MagpieConfig:
    count: int = 20000  # prompts to keep (of every source) before the stage stops
    batch_size: int = 64  # requests decoding at once
    round_size: int = 1024  # user turns sampled per resumable round
    max_tokens: int = 96  # a user turn longer than this is dropped
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0
    follow_up_share: float = 0.0  # (follow-ups) share of answered conversations that get a second turn
    dev_share: float = 0.01  # of the written prompts, marked "dev": answered, never trained on
    filter: PromptFilter = field(default_factory=PromptFilter)


# Called after each durable append with the kind ("prompts" or "answers") and the records
# appended: a CorpusStore (heads/training/store.py) seals them into the repository's shards.
OnWritten = Callable[[str, list[dict]], None]


def add_prompts(
    folder: str | Path,
    texts: list[str],
    source: str,
    held_out: Iterable[str] = (),
    on_written: OnWritten | None = None,
) -> int:
    """Append prompts of another source (built-in templates, a user file), skipping exact
    duplicates of what the folder holds and exact or near duplicates of a held-out prompt (a
    source's own prompts may share a passage with different tasks: they are kept). Returns how
    many were added."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    records = read_records(folder / PROMPTS)
    held = _index([], held_out)
    exact = {normalise(r["messages"][-1]["content"]) for r in records}
    fresh = []
    for text in texts:
        key = normalise(text)
        if key not in exact and not held.contains(text):
            exact.add(key)
            fresh.append({"id": len(records) + len(fresh), "source": source,
                          "messages": [{"role": "user", "content": text}]})  # fmt: skip
    _append(folder / PROMPTS, fresh)
    if on_written is not None and fresh:
        on_written("prompts", fresh)
    return len(fresh)


def _index(records: list[dict], held_out: Iterable[str]) -> NearDuplicates:
    seen = NearDuplicates()
    for text in held_out:
        seen.add(text)
    for record in records:
        seen.add(record["messages"][-1]["content"])
    return seen


def synthesize_prompts(
    model: PreTrainedModel | Target,
    tokenizer,
    folder: str | Path,
    config: MagpieConfig,
    *,
    held_out: Iterable[str] = (),
    progress: bool = True,
    on_written: OnWritten | None = None,
) -> dict:
    """Sample user turns from the target until ``config.count`` prompts are kept; returns the
    stage's state (also in ``state.json``). ``held_out`` prompts (dev, benchmark) and their near
    duplicates are never kept."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = model if isinstance(model, Target) else Target(model)
    state_path = folder / STATE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    magpie = state.setdefault("magpie", {"rounds": 0, "sampled": 0, "kept": 0, "dropped": {}})
    prompts_path = folder / PROMPTS
    # A round cut short by a kill left at most some of its records (a partial last line is cut
    # off here); it is sampled again with the same seed, and what it already wrote is dropped
    # as duplicates.
    records = read_records(prompts_path)
    seen = _index(records, held_out)
    prefix = template_prefix(tokenizer, [])
    stops = end_of_turn_ids(target.model, tokenizer)
    bar = tqdm(total=config.count, initial=min(len(records), config.count), desc="writing prompts",
               unit="prompt", smoothing=0, disable=not progress)  # fmt: skip
    start, sampled_tokens = time.perf_counter(), 0
    while len(records) < config.count:
        texts, tokens = _sample_round(target, tokenizer, prefix, stops, config, magpie["rounds"])
        sampled_tokens += tokens
        dropped = Counter(magpie["dropped"])
        fresh = _keep(texts, seen, config, first_id=len(records), dropped=dropped)
        fresh = fresh[: config.count - len(records)]
        _append(prompts_path, fresh)
        records += fresh
        magpie.update(rounds=magpie["rounds"] + 1,
                      sampled=magpie["sampled"] + len(texts), kept=magpie["kept"] + len(fresh),
                      dropped=dict(dropped), config=asdict(config))  # fmt: skip
        _write_json(state_path, state)
        if on_written is not None:  # after the state: a sealed round resumes after itself
            on_written("prompts", fresh)
        bar.update(len(fresh))
        bar.set_postfix(tok_per_s=f"{sampled_tokens / (time.perf_counter() - start):.0f}",
                        kept=f"{magpie['kept'] / max(magpie['sampled'], 1):.0%}")  # fmt: skip
    bar.close()
    return state


def _keep(
    texts: list[tuple[str, bool]], seen, config: MagpieConfig, first_id: int, dropped: Counter
) -> list[dict]:
    """The prompt records of a round's sampled turns that pass the filter and are new (ids from
    ``first_id``; a share marked dev); each dropped one counted under its reason."""
    fresh = []
    for text, finished in texts:
        reason = "unfinished" if not finished else config.filter.reason_to_drop(text)
        if reason is None and not seen.add(text):
            reason = "duplicate"
        if reason is not None:
            dropped[reason] += 1
            continue
        index = first_id + len(fresh)
        fresh.append({"id": index, "source": "magpie",
                      "split": "dev" if _share(index, config.seed + 2) < config.dev_share else "train",
                      "messages": [{"role": "user", "content": text}]})  # fmt: skip
    return fresh


def _sample_round(target, tokenizer, prefix, stops, config: MagpieConfig, round_index: int):
    """One round of ``round_size`` sampled user turns: (text, ended with a stop token) each."""
    generator = torch.Generator(device=target.device).manual_seed(config.seed * 1_000_003 + round_index)
    sampling = SamplingParams(config.temperature, None, config.top_p)
    prompts = [prefix] * config.round_size
    outputs = _run(target, prompts, [sampling] * len(prompts), config.max_tokens, stops,
                   config.batch_size, generator)  # fmt: skip
    out = []
    for tokens, reason in outputs:
        finished = reason == "eos"
        body = [t for t in tokens if t not in stops]
        out.append((tokenizer.decode(body, skip_special_tokens=False).strip(), finished))
    return out, sum(len(t) for t, _ in outputs)


def _run(target, prompts, samplings, max_new_tokens, stops, batch_size, generator, on_finish=None,
         keep_going=None, max_len=None):  # fmt: skip
    """Decode the prompts through one continuous-batching engine, fed as slots free up; returns
    (tokens, finish reason) per prompt (None for prompts never started), and calls
    ``on_finish(index, tokens, reason)`` as each one ends. Once ``keep_going()`` is False no new
    prompt starts; those running finish."""
    max_len = max_len or max(len(p) for p in prompts) + max_new_tokens
    # One uniform per sampled row instead of torch.multinomial's exponential per vocabulary entry:
    # the same distribution, and the decode step at batch 64 ~20 % cheaper (docs/processors.md).
    engine = Engine(target, max_batch_size=batch_size, max_len=max_len, generator=generator,
                    sampler="inverse-cdf")  # fmt: skip
    shared = os.path.commonprefix(prompts)  # the chat template's opening, the system message
    if len(shared) >= 8:  # computed once instead of once per prompt (Magpie: the whole prompt)
        engine.pin_prefix(shared)
    queue = iter(enumerate(zip(prompts, samplings, strict=True)))
    ids: dict[int, int] = {}
    results: list[tuple[list[int], str] | None] = [None] * len(prompts)
    in_flight = 0

    def feed() -> None:
        nonlocal in_flight
        while in_flight < 2 * batch_size and (keep_going is None or keep_going()):
            item = next(queue, None)
            if item is None:
                return
            index, (prompt, sampling) = item
            ids[
                engine.add_request(
                    prompt, max_new_tokens=max_new_tokens, eos_token_id=stops, sampling=sampling
                )
            ] = index
            in_flight += 1

    feed()
    while engine.has_unfinished():
        for produced in engine.step():
            if produced.finished:
                request = engine.pop(produced.request_id)
                index = ids[produced.request_id]
                results[index] = (request.output, request.finish_reason)
                in_flight -= 1
                if on_finish is not None:
                    on_finish(index, request.output, request.finish_reason)
        feed()
    return results


def _follow_up_candidates(records: list[dict], answers: dict[int, dict], config: MagpieConfig) -> list[dict]:
    """The single-turn prompts whose answer ended on its own (EOS) and that have no follow-up yet,
    a ``follow_up_share`` of them chosen by id."""
    done = {r["parent"] for r in records if "parent" in r}
    return [
        r for r in records
        if len(r["messages"]) == 1 and r["id"] in answers and r["id"] not in done
        and answers[r["id"]]["finish"] == "eos" and _share(r["id"], config.seed + 1) < config.follow_up_share
    ]  # fmt: skip


def synthesize_follow_ups(
    model: PreTrainedModel | Target,
    tokenizer,
    folder: str | Path,
    config: MagpieConfig,
    *,
    held_out: Iterable[str] = (),
    progress: bool = True,
    on_written: OnWritten | None = None,
) -> list[int]:
    """Second turns: for a ``config.follow_up_share`` of the answered single-turn conversations
    (chosen by id, so a rerun picks the same), the target writes a follow-up question after its
    own answer; each kept one is a new prompt record of three messages. Returns their ids.
    Run it after :func:`write_answers`; answer the new records with a second
    :func:`write_answers` call."""
    folder = Path(folder)
    target = model if isinstance(model, Target) else Target(model)
    records = read_records(folder / PROMPTS)
    answers = {a["id"]: a for a in read_records(folder / ANSWERS)}
    chosen = _follow_up_candidates(records, answers, config)
    if not chosen:
        return []
    seen = _index(records, held_out)
    stops = end_of_turn_ids(target.model, tokenizer)
    conversations = [
        r["messages"] + [{"role": "assistant", "content": _answer_text(tokenizer, answers[r["id"]], stops)}]
        for r in chosen
    ]
    prefixes = [template_prefix(tokenizer, c) for c in conversations]
    added: list[str] = []
    bar = tqdm(total=len(chosen), desc="writing follow-ups", unit="prompt", smoothing=0, disable=not progress)
    for first in range(0, len(chosen), config.round_size):
        part = slice(first, first + config.round_size)
        generator = torch.Generator(device=target.device).manual_seed(config.seed * 7919 + first)
        sampling = SamplingParams(config.temperature, None, config.top_p)
        outputs = _run(target, prefixes[part], [sampling] * len(prefixes[part]), config.max_tokens, stops,
                       config.batch_size, generator)  # fmt: skip
        fresh = []
        for record, conversation, (tokens, reason) in zip(
            chosen[part], conversations[part], outputs, strict=True
        ):
            text = tokenizer.decode([t for t in tokens if t not in stops]).strip()
            if reason != "eos" or config.filter.reason_to_drop(text) or not seen.add(text):
                continue
            fresh.append({"id": len(records) + len(fresh), "source": "follow-up", "parent": record["id"],
                          "messages": conversation + [{"role": "user", "content": text}]})  # fmt: skip
        _append(folder / PROMPTS, fresh)
        if on_written is not None and fresh:
            on_written("prompts", fresh)
        records += fresh
        added += [r["id"] for r in fresh]
        bar.update(len(outputs))
    bar.close()
    return added


def _answer_text(tokenizer, answer: dict, stops: list[int]) -> str:
    return tokenizer.decode([t for t in answer["answer"] if t not in stops]).strip()


def _share(record_id: int, salt: int) -> float:
    """A fixed pseudo-random number in [0, 1) per record id: which records are sampled or get a
    follow-up does not depend on the order they run in."""
    digest = hashlib.blake2b(f"{salt}:{record_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


# --------------------------------------------------------------------------------------------
# Stage 2: answers
# --------------------------------------------------------------------------------------------


@dataclass
class AnswerConfig:
    max_new_tokens: int = 256
    batch_size: int = 64
    sampled_share: float = 0.2  # of the answers, sampled at ``temperature`` instead of greedy
    temperature: float = 0.7
    max_prompt_tokens: int = 1024  # a longer conversation is skipped
    answer_tokens: int | None = None  # stop once the file holds this many answer tokens
    seed: int = 0
    flush_every: int = 16  # answers buffered before an append


def _pending_answers(
    folder: Path, tokenizer, config: AnswerConfig, only: Iterable[int] | None
) -> tuple[list[tuple[dict, list[int]]], int]:
    """(record, prompt ids) of every prompt still to answer (of ``only`` when given; prompts
    longer than ``max_prompt_tokens`` left out; none once ``answer_tokens`` are written), and the
    answer tokens already written."""
    records = read_records(folder / PROMPTS)
    if not records:
        raise ValueError(
            f"{folder / PROMPTS} holds no prompts: write them first (treespec train-heads prompts)"
        )
    done = read_records(folder / ANSWERS)
    answered = {a["id"] for a in done}
    total = sum(len(a["answer"]) for a in done)
    if config.answer_tokens is not None and total >= config.answer_tokens:
        return [], total  # enough answers already
    wanted = None if only is None else set(only)
    todo = [r for r in records if r["id"] not in answered and (wanted is None or r["id"] in wanted)]
    encoded = [(r, chat_ids(tokenizer, r["messages"])) for r in todo]
    return [(r, ids) for r, ids in encoded if len(ids) <= config.max_prompt_tokens], total


def _answer_sampling(record_id: int, config: AnswerConfig) -> SamplingParams:
    """Sampled at ``config.temperature`` for the ``sampled_share`` of ids a seeded hash picks, else greedy."""
    if _share(record_id, config.seed) < config.sampled_share:
        return SamplingParams(config.temperature)
    return SamplingParams()


def write_answers(
    model: PreTrainedModel | Target,
    tokenizer,
    folder: str | Path,
    config: AnswerConfig,
    *,
    only: Iterable[int] | None = None,
    progress: bool = True,
    on_written: OnWritten | None = None,
) -> dict:
    """Answer every prompt of ``folder/prompts.jsonl`` that ``answers.jsonl`` lacks (``only``:
    of these ids); returns a summary (answers, answer tokens, tokens/s of this run)."""
    folder = Path(folder)
    target = model if isinstance(model, Target) else Target(model)
    answers_path = folder / ANSWERS
    encoded, total = _pending_answers(folder, tokenizer, config, only)
    stops = end_of_turn_ids(target.model, tokenizer)
    bar = tqdm(total=config.answer_tokens or len(encoded) * config.max_new_tokens, initial=total,
               desc="answering", unit="tok", smoothing=0, disable=not progress)  # fmt: skip
    start, new_tokens, buffer = time.perf_counter(), 0, []
    samplings = [_answer_sampling(record["id"], config) for record, _ in encoded]

    def flush():
        _append(answers_path, buffer)
        if on_written is not None and buffer:
            on_written("answers", list(buffer))
        buffer.clear()

    def finish(index, tokens, reason):
        nonlocal total, new_tokens
        record, ids = encoded[index]
        buffer.append({"id": record["id"], "prompt": ids, "answer": tokens, "finish": reason,
                       "temperature": samplings[index].temperature})  # fmt: skip
        total += len(tokens)
        new_tokens += len(tokens)
        if len(buffer) >= config.flush_every:
            flush()
        bar.update(len(tokens))
        bar.set_postfix(tok_per_s=f"{new_tokens / (time.perf_counter() - start):.0f}")

    if encoded:
        first_id = encoded[0][0]["id"]
        generator = torch.Generator(device=target.device).manual_seed(config.seed * 1_000_003 + first_id)
        _run(target, [ids for _, ids in encoded], samplings, config.max_new_tokens, stops, config.batch_size,
             generator, on_finish=finish, max_len=config.max_prompt_tokens + config.max_new_tokens,
             keep_going=lambda: config.answer_tokens is None or total < config.answer_tokens)  # fmt: skip
        flush()
    bar.close()
    wall = time.perf_counter() - start
    return {"answers": len(read_records(answers_path)), "answer_tokens": total, "new_tokens": new_tokens,
            "wall_s": wall, "tokens_per_s": new_tokens / wall if wall else 0.0}  # fmt: skip
