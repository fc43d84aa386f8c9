"""Proposers: the drafters behind one small protocol (see base.py)."""

from treespec.proposers.base import ProposalRequest, Proposer
from treespec.proposers.draft import DraftModelProposer
from treespec.proposers.eagle import EagleProposer
from treespec.proposers.hybrid import HybridProposer
from treespec.proposers.medusa import MedusaProposer
from treespec.proposers.ngram import NgramProposer
from treespec.proposers.routed import RoutedProposer

__all__ = [
    "DraftModelProposer",
    "EagleProposer",
    "HybridProposer",
    "MedusaProposer",
    "NgramProposer",
    "ProposalRequest",
    "Proposer",
    "RoutedProposer",
]
