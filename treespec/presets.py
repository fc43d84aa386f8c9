"""What each proposer drafts unless told otherwise, defined once: ``treespec bench``,
``proposer="auto"``, the heads' training-time tau and the step benchmarks all read these.

Each tree preset is the keyword arguments of its proposer's constructor. The adaptive budget
(treespec.budget) trims a tree below its preset size every step; ``--budget fixed`` drafts it
whole, the size tau is quoted at.
"""

from __future__ import annotations

from types import MappingProxyType

# EAGLE-2's dynamic tree: expand the top_k best nodes per level, depth levels, keep total_tokens.
EAGLE_TREE = MappingProxyType({"depth": 6, "top_k": 8, "total_tokens": 31})
# Medusa heads: EAGLE-2 growth over the heads' marginals, (top_k, nodes).
MEDUSA_TREE = MappingProxyType({"dynamic": (8, 31)})
# A draft model's dynamic tree: (top_k, depth, nodes).
DRAFT_TREE = MappingProxyType({"dynamic": (4, 6, 31)})
# Prompt lookup: up to max_nodes drafted tokens, chains of at most max_depth.
NGRAM_TREE = MappingProxyType({"max_depth": 8, "max_nodes": 32})
# The hybrid: a smaller EAGLE tree beside an n-gram chain, sharing one verification.
HYBRID_EAGLE_TREE = MappingProxyType({**EAGLE_TREE, "total_tokens": 24})
HYBRID_NGRAM_TREE = MappingProxyType({"max_depth": 8, "max_nodes": 8})

# Heads without a draft vocabulary of their own (EAGLE-1 without d2t, Medusa, draft models) read
# out through the first DRAFT_VOCAB token ids; training uses the same number of rows.
DRAFT_VOCAB = 8192

# Context tokens per request (prompt + output) when nobody says how many; a shorter model
# context wins (treespec.target.cache.default_max_len).
DEFAULT_MAX_LEN = 4096

# Which of the corpus's answers a features folder holds (train-heads features --answers): every
# one, only those answered greedily, or only the sampled ones.
ANSWER_SELECTIONS = ("all", "greedy", "sampled")
