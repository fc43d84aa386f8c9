"""Token trees: static tree shapes (path tuples) and the flattened ragged batch of trees.

Terminology:
    root     node 0 of every request's tree: its last committed token, whose K/V is not cached
             yet. The root is the empty path ``()``.
    path     a root-to-node tuple of ranks: ``path[i]`` is the top-k rank taken at depth i + 1
             (the encoding Medusa and vLLM use). ``(0, 1)`` is the 2nd-best child of the best
             child of the root.
    shape    a :class:`TreeShape`: a validated, sorted set of paths, with everything derived
             from it once (parents, depths, ancestor bitmask, leaf paths).
    tree     a :class:`TokenTree`: B requests' trees flattened into one ragged batch, the form
             the target scores and the verifier reads.

Pure structures: nothing here touches a model or device state beyond the tensors it builds.
Homes: ``masks`` (the ancestor bitmasks), ``token_tree`` (the flattened batch), ``shapes`` (static
shapes and the best shape for measured rates), ``builders`` (tokens on a shape or a dynamic tree).
"""

from treespec.tree.builders import (
    ExpandFn,
    budget_top_k,
    build_dynamic_tree,
    build_static_tree,
    check_dynamic_budget,
    dynamic_capacity,
    fit_dynamic_budget,
)
from treespec.tree.masks import (
    BITS_PER_WORD,
    NO_PARENT,
    ancestor_bits,
    chain_mask,
    extend_ancestors,
    pack_ancestor_mask,
    pack_bits,
    words_from_bits,
)
from treespec.tree.shapes import (
    PRESETS,
    Path,
    TreeShape,
    best_paths,
    best_tree,
    chain,
    expected_accepted_length,
    full_tree,
)
from treespec.tree.token_tree import TokenTree, TreeHost, host_structure, most_children

__all__ = [
    "BITS_PER_WORD", "NO_PARENT", "PRESETS", "ExpandFn", "Path", "TokenTree", "TreeHost", "TreeShape",
    "ancestor_bits", "best_paths", "budget_top_k", "best_tree", "build_dynamic_tree", "build_static_tree", "chain",
    "chain_mask", "check_dynamic_budget", "dynamic_capacity", "expected_accepted_length", "extend_ancestors",
    "fit_dynamic_budget", "full_tree", "host_structure", "most_children", "pack_ancestor_mask", "pack_bits",
    "words_from_bits",
]  # fmt: skip
