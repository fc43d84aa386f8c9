"""treespec's own default prompts for benchmarks and examples (written for this project)."""

from __future__ import annotations

import json
from pathlib import Path

PASSAGE = (
    "The library in the village of Ashford opened in 1911 with three hundred books donated by a"
    " retired sea captain. For decades it occupied a single room above the post office, and the"
    " librarian, Margaret Hale, knew every reader by name. In 1968 a flood damaged half of the "
    "collection, and the villagers spent a whole summer drying pages on washing lines across th"
    "e green. The building that houses the library today was finished in 1975, paid for by a de"
    "cade of bake sales and a grant from the county. It now lends films and tools as well as bo"
    "oks, and its reading group has met every Thursday evening for more than forty years."
)

BENCH_PROMPTS: list[tuple[str, str]] = [
    ("chat", "Give three practical tips for keeping a small vegetable garden healthy in a dry summer."),
    ("chat", "Describe how a bicycle's gears make it easier to ride uphill."),
    (
        "code",
        "Write a short Python function that returns the n-th Fibonacci number, and explain how it works.",
    ),
    ("code", "What is the difference between a list and a tuple in Python? Answer with an example."),
    ("maths", "A train leaves at 9:15 and arrives at 11:40. How long is the journey? Show your steps."),
    (
        "maths",
        "A rectangle is 12 cm long and 7 cm wide. What are its area and its perimeter? Show your steps.",
    ),
    ("summarisation", "Summarise the following passage in two sentences.\n\n" + PASSAGE),
    (
        "summarisation",
        "Summarise the plot of a story about a lighthouse keeper who finds a message in a bottle.",
    ),
    ("qa", "Explain in a few sentences why the sky looks blue during the day and red at sunset."),
    ("qa", "List the planets of the solar system in order from the sun, with one fact about each."),
]
"""(category, prompt) pairs: ``treespec bench``'s default set. No head is trained on them."""

DEFAULT_PROMPTS = [text for _, text in BENCH_PROMPTS]


def encode_prompts(tokenizer, prompts: list[str], *, chat: bool = True) -> list[list[int]]:
    """Token ids of each prompt, wrapped in the tokenizer's chat template when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        return [
            list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
            for p in prompts
        ]
    return [tokenizer(p)["input_ids"] for p in prompts]


PROMPT_FIELDS = ("turns[0]", "question", "prompt")


def read_prompt_records(path: str | Path) -> list[tuple[str, str]]:
    """(category, prompt) pairs from a prompt file: JSON lines (the prompt is ``turns[0]``,
    ``question`` or ``prompt``, the first that exists; the category ``category``, else "all"),
    or plain text with one prompt per non-empty line (category "all")."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    lines = [line for line in file.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"prompt file {path} is empty: it holds no prompts")
    if not lines[0].lstrip().startswith("{"):
        return [("all", line) for line in lines]
    out = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        text = (
            (turns[0] if isinstance(turns, list) and turns else None)
            or row.get("question")
            or row.get("prompt")
        )
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}:{number}: no usable prompt; looked for {', '.join(PROMPT_FIELDS)}")
        out.append((str(row.get("category", "all")), text))
    return out
