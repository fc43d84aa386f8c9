"""Prompts for training heads, and the dev prompts their acceptance is measured on.

Three disjoint sets (docs/training.md records the split):

- **train**: composed here from templates (chat, code, maths, summaries, questions) and from
  the documentation topics that ship with Python (``pydoc_data.topics``), a few hundred in all;
- **dev**: :data:`DEV_PROMPTS`, written separately, never trained on; the per-epoch tau is
  measured on them;
- **benchmark**: ``treespec.prompts.DEFAULT_PROMPTS``, used by ``treespec bench`` and by
  nothing here. :func:`train_prompts` checks that no train prompt equals a dev or benchmark one.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from treespec.prompts import DEFAULT_PROMPTS, read_prompt_records

DEV_PROMPTS = [
    "Why do cats purr, and what might it mean when they do?",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "A shop sells pens at 3 for 2 dollars. How much do 18 pens cost? Explain your reasoning.",
    "Give three tips for someone who wants to start running regularly.",
    "How does a refrigerator keep food cold?",
    "Write a short poem about autumn leaves falling in a city park.",
    "Summarise the main causes of the French Revolution in a few sentences.",
    "What should a beginner know before adopting a dog?",
]

_TOPICS = ["photosynthesis", "the water cycle", "volcanoes", "black holes", "the immune system", "magnets",
           "earthquakes", "the moon's phases", "rainbows", "tides", "vaccines", "electric circuits",
           "the printing press", "the Roman Empire", "the internet", "honeybees", "glaciers", "coral reefs",
           "compound interest", "inflation", "supply and demand", "democracy", "recycling", "sleep",
           "memory", "music scales", "chess openings", "bread baking", "coffee roasting", "bicycles"]  # fmt: skip
_CODE_TASKS = ["reverses a linked list", "counts the words in a text file", "merges two sorted lists",
               "computes the n-th Fibonacci number iteratively", "removes duplicates from a list while keeping order",
               "parses a date string in the format YYYY-MM-DD", "finds the largest element in a binary tree",
               "implements binary search", "flattens a nested list", "converts Celsius to Fahrenheit",
               "validates an email address with a regular expression", "computes the factorial of a number",
               "transposes a matrix", "groups words that are anagrams", "checks if a number is prime",
               "reads a CSV file and sums a column", "implements a stack with push and pop",
               "returns the most common character in a string"]  # fmt: skip
_LANGUAGES = ["Python", "JavaScript", "C", "Rust"]
_PEOPLE = ["a farmer", "a student", "a nurse", "a pilot", "a baker", "a teacher", "an engineer", "a painter"]
_NAMES = ["Ana", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hugo"]
_ITEMS = ["apples", "pencils", "books", "marbles", "stickers", "cookies"]


def _maths(rng: random.Random) -> list[str]:
    out = []
    for name, item in itertools.product(_NAMES, _ITEMS):
        a, b, c = rng.randint(3, 40), rng.randint(2, 9), rng.randint(1, 12)
        out.append(f"{name} has {a} {item}, buys {b} packs of {c} more and gives away {c + 1}. "
                   f"How many {item} does {name} have now? Explain step by step.")  # fmt: skip
    return rng.sample(out, 36)


def _pydoc_prompts(limit_chars: int = 1200) -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - every CPython ships it
        return []
    out, seen = [], set()
    for name in sorted(topics):
        text = " ".join(topics[name].split())[:limit_chars]
        if len(text) < 200 or text in seen:  # some topics share one page
            continue
        seen.add(text)
        out.append(f"Explain the following part of the Python documentation in simple terms:\n\n{text}")
        out.append(f"Summarise this passage in three sentences:\n\n{text}")
        out.append(
            f"Write a short Python example that illustrates the topic '{name}', based on:\n\n{text[:600]}"
        )
    return out


def train_prompts(seed: int = 0) -> list[str]:
    """The project's training prompts (a few hundred), in a fixed shuffled order."""
    rng = random.Random(seed)
    prompts = [f"Explain {topic} to a curious twelve-year-old." for topic in _TOPICS]
    prompts += [f"What are the advantages and disadvantages of {topic}?" for topic in _TOPICS[15:]]
    prompts += [
        f"Write a {lang} function that {task}."
        for lang, task in itertools.product(_LANGUAGES[:2], _CODE_TASKS)
    ]
    prompts += [
        f"Write a {lang} program that {task}."
        for lang, task in zip(_LANGUAGES[2:] * 9, _CODE_TASKS, strict=False)
    ]
    prompts += [f"Describe a typical working day of {person}." for person in _PEOPLE]
    prompts += [f"Write a short story about {person} who finds {item} in an old box."
                for person, item in zip(_PEOPLE, _ITEMS * 2, strict=False)]  # fmt: skip
    prompts += _maths(rng)
    prompts += _pydoc_prompts()
    rng.shuffle(prompts)
    held_out = set(DEV_PROMPTS) | set(DEFAULT_PROMPTS)
    leaked = [p for p in prompts if p in held_out]
    if leaked:  # pragma: no cover - a guard on the constants above
        raise RuntimeError(f"train prompts overlap the dev or benchmark prompts: {leaked[:2]}")
    return prompts


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts from a file (``treespec.prompts.read_prompt_records``: JSON lines with
    ``turns[0]``, ``question`` or ``prompt``, or plain text with one prompt per line)."""
    return [text for _, text in read_prompt_records(path)]
