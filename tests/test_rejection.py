"""Recursive rejection on the host leaves the tree it reads alone, whatever its dtype."""

from __future__ import annotations

import pytest
import torch

from specimg import DraftTree
from specimg.accept import reject_forest
from specimg.testing.conformance import emission

P = torch.tensor([0.05, 0.15, 0.80], dtype=torch.float64)
Q = [0.9, 0.1, 0.0]


def two_children(dtype: torch.dtype) -> DraftTree:
    """The root's children 0 and 1, drawn from Q: child 0 is rejected most of the time."""
    draft = torch.tensor([Q, [0.0] * 3, [0.0] * 3], dtype=dtype)
    return DraftTree.from_parents([2, 0, 1], [-1, 0, 0], draft_probs=draft, sampled=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rejection_keeps_the_draft_rows(dtype: torch.dtype):
    tree = two_children(dtype)
    before = tree.draft_probs.clone()
    for seed in range(20):
        reject_forest(tree, [0], torch.stack([P] * 3), [torch.Generator().manual_seed(seed)])[0]
    assert torch.equal(tree.draft_probs, before)


def test_a_float64_tree_has_the_law_of_a_float32_one():
    """Every draw enumerated, so exact: the rule reads q afresh each call (a row changed in
    place by an earlier call would drift toward accepting everything)."""
    laws = [emission(lambda g, tree=two_children(dtype): reject_forest(tree, [0], torch.stack([P] * 3), [g])[0], two_children(dtype), 3)[1]
            for dtype in (torch.float32, torch.float64)]
    assert torch.allclose(laws[0], laws[1], atol=1e-6)
