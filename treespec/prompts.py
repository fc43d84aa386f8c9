"""treespec's own default prompts for benchmarks and examples (written for this project)."""

from __future__ import annotations

DEFAULT_PROMPTS = [
    "Explain in a few sentences why the sky looks blue during the day and red at sunset.",
    "Write a short Python function that returns the n-th Fibonacci number, and explain how it works.",
    "A train leaves at 9:15 and arrives at 11:40. How long is the journey? Show your steps.",
    "Give three practical tips for keeping a small vegetable garden healthy in a dry summer.",
    "Summarise the plot of a story about a lighthouse keeper who finds a message in a bottle.",
    "What is the difference between a list and a tuple in Python? Answer with an example.",
    "Describe how a bicycle's gears make it easier to ride uphill.",
    "List the planets of the solar system in order from the sun, with one fact about each.",
]


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
