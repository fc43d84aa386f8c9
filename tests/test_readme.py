"""The README's Python examples run as written, in bf16 (as printed) and in fp32 (slow: they
load the real default model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_python_examples():
    assert len(python_blocks()) >= 4


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_readme_examples_run_as_written(dtype):
    """Every block in order, in one namespace (later blocks use earlier names), with only the
    model's dtype changed for the fp32 run."""
    blocks = python_blocks()
    assert "dtype=torch.bfloat16" in blocks[0]
    blocks = [block.replace("dtype=torch.bfloat16", f"dtype=torch.{dtype}") for block in blocks]
    namespace: dict = {"__name__": "readme"}
    for number, block in enumerate(blocks, 1):
        exec(compile(block, f"README.md python block {number}", "exec"), namespace)  # noqa: S102
    assert namespace["out"].committed_tokens(namespace["tree"])  # the last block's verify ran
    assert str(namespace["model"].dtype) == f"torch.{dtype}"
