"""The target side: the HF model behind one ragged forward with the tree-attention hook
(``runner``), its preallocated K/V (``cache``), the CPU linear backends (``linear``) and the
decoder stack as one C call (``fused``)."""

from treespec.target.runner import StepMetadata, Target, TargetOutput

__all__ = ["StepMetadata", "Target", "TargetOutput"]
