"""cascade: CASCADE, context-aware relaxation from the verification pass's own hidden states.

The target's last hidden state F_v (after the final norm, conditional row) at tree node v
says what the model "sees" after consuming v's token in v's context; the verification
forward computes it for every node anyway.  Where two nodes' states agree, their tokens
are interchangeable in this context.  Per tree node u (depth d), for each child c of u in
draft-rank order:

    I(c)    = nodes v at depth d+1 in other branches (parent(v) != u) with cos(F_c, F_v) >= tau_pos
    C(c)    = nodes v at depth d or d+2 with cos(F_c, F_v) >= tau_seq   (the sequence converges)
    q_R(c) += mass under p_u of the tokens of I(c) and C(c), most similar first,
              while the node's budget delta lasts

c's siblings are excluded from I(c): their tokens are candidates of u and never donate.

Budget (``budget``): "node" gives each node delta, as every method does; "step" is the
paper's fixed budget per verification step: one delta spent along each root-to-leaf path,
the root first, so that the per-node TVDs of q_R to p on any path sum to at most delta
(the paper's mode, delta 0.5).  A node's budget is then what its ancestors left:

    budget(u) = min(delta_u, delta - sum over u's ancestors a of TVD(q_R,a, p_a))

Beyond the tree (``beyond_tree`` = k > 0; specimg's extension, not the paper's rule): after
I(c) and C(c), the k tokens whose input embeddings are nearest to c's donate too, a cheap
proxy of state similarity for the mass that lies off the tree, within the same budget.

Drafter training (CASCADE, arXiv 2605.07230): the soft cross-entropy at position t is
scaled by (1 + beta) where the sequence converges as C(c) sees it along a branch, cos(F_t,
F_{t-1}) >= tau_seq (a node and its parent are consecutive positions), with F_t the same
state: the one produced by consuming token t.  The feature regression is left alone.  An
EAGLE-3 drafter's parts come per unrolled step ([K, B, T], ``features`` aligned to them):
each step's soft cross-entropy is scaled by the same rule at the position it predicts.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
from attrs import validators as v
from torch import Tensor

from specimg import DraftTree, MethodSpec, Scores, Target, embedding_donors, hookimpl, transfer
from specimg.relax import tvd


@attrs.frozen
class CascadeOptions:
    """tau_pos, tau_seq: cosine thresholds for I(c) and C(c) (calibrated on the demo:
    docs/methods.md); delta: TVD budget per node; beta: extra weight of the drafter's soft
    cross-entropy at convergent positions; beyond_tree: donors from outside the tree, the k
    tokens nearest c by input embedding (0: the paper's rule, tree tokens only); budget:
    delta per node ("node") or per verification step along each path ("step", the paper's)."""

    tau_pos: float = attrs.field(default=0.5, validator=[v.ge(-1.0), v.le(1.0)])
    tau_seq: float = attrs.field(default=0.5, validator=[v.ge(-1.0), v.le(1.0)])
    delta: float = 0.5
    beta: float = attrs.field(default=1.0, validator=v.ge(0.0))
    beyond_tree: int = attrs.field(default=0, validator=v.ge(0))
    budget: str = attrs.field(default="node", validator=v.in_(("node", "step")))


@hookimpl
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    register(MethodSpec(
        "cascade", CascadeOptions, "CASCADE: candidates take the mass of tokens whose tree states match theirs",
        paper={"budget": "step"},
        departures=(
            "the paper gives no thresholds for VQ image models; tau_pos and tau_seq 0.5 were calibrated on the demo. The paper "
            "spends delta once per verification step (budget=step: the TVDs along any root-to-leaf path sum to at most delta); "
            "specimg's default gives every node delta, the per-position guarantee every other method keeps"
        ),
        batch=True,
    ))


@hookimpl
def build_relaxed_dist(
    dist: Tensor, target_dist: Tensor, budget: Tensor, tree: DraftTree, scores: Scores, target: Target, options: CascadeOptions
) -> Tensor:
    candidates, ids = (t.to(dist.device) for t in tree.candidates())
    donors = context_donors(tree, scores.hidden[0].to(dist.device), ids, options.tau_pos, options.tau_seq)
    if options.beyond_tree:
        donors = torch.cat([donors, embedding_donors(target, candidates, options.beyond_tree)], dim=-1)
    budget = budget.to(dist.device)
    if options.budget == "node":
        return transfer(dist, target_dist, candidates, donors, budget)[0]
    return along_paths(dist, target_dist, candidates, donors, budget, tree, options.delta)


def along_paths(dist: Tensor, target_dist: Tensor, candidates: Tensor, donors: Tensor, budget: Tensor, tree: DraftTree, delta: float) -> Tensor:
    """``transfer`` with one ``delta`` per root-to-leaf path (budget="step"): depth by depth
    from the roots, each node gets what its path has left, at most its own ``budget``; the
    TVD already spent at a node (by earlier members of a stack) counts against its path."""
    depths, parents = tree.depths.to(dist.device), tree.parents.to(dist.device)
    spent_above = torch.zeros_like(budget, dtype=torch.float64)  # the TVD on each node's strict ancestors
    for depth in range(tree.height):  # the last depth's nodes have no candidates
        here = depths == depth
        left = (delta - spent_above - tvd(dist, target_dist)).clamp(min=0)
        dist = transfer(dist, target_dist, candidates, donors, torch.where(here, torch.minimum(budget, left.to(budget.dtype)), 0.0))[0]
        through = spent_above + tvd(dist, target_dist)  # the path's TVD up to and including each node
        spent_above = torch.where((depths == depth + 1) & (parents >= 0), through[parents.clamp(min=0)], spent_above)
    return dist


def context_donors(tree: DraftTree, hidden: Tensor, ids: Tensor, tau_pos: float, tau_seq: float) -> Tensor:
    """Donor tokens [n, C, K] of each candidate node ``ids`` [n, C] (-1 = none): the nodes
    of the candidate's own tree (each tree of a forest padded to the largest, K nodes)
    ranked by the cosine of their states ``hidden`` [n, D], one K x K matrix per tree."""
    device = hidden.device
    image, local, slot = (t.to(device) for t in tree.places())
    feats = torch.zeros(*slot.shape, hidden.shape[-1], dtype=torch.float64, device=device)
    feats[image, local] = unit_states(hidden).double()
    sim = (feats @ feats.transpose(1, 2)).float()  # in float64 and then rounded: a tree's product rounds as alone in any batch, so near-equal donors keep their order
    node = ids.clamp(min=0)
    own = image[node]
    s = sim[own, local[node]]  # [n, C, K]: against every place of the candidate's own tree
    columns = slot[own]  # the node at each of those places (-1: padding)
    depths, parents, tokens = (t.to(device) for t in (tree.depths, tree.parents, tree.tokens))
    gap = depths[columns] - depths[node][..., None]
    other_branch = (gap == 0) & (parents[columns] != parents[node][..., None])
    keep = ((other_branch & (s >= tau_pos)) | ((gap.abs() == 1) & (s >= tau_seq))) & (columns >= 0) & (ids >= 0)[..., None]
    order = torch.where(keep, s, torch.full_like(s, -torch.inf)).argsort(dim=-1, descending=True, stable=True)  # every node a slot: no host read
    return torch.where(keep.gather(-1, order), tokens[columns.gather(-1, order)], torch.full_like(order, -1))


def unit_states(hidden: Tensor) -> Tensor:
    """The target's last hidden states (after the final norm), L2-normalised in float32:
    what both the inference rule and the training rule compare by cosine."""
    return F.normalize(hidden.float(), dim=-1)


def convergent_positions(features: Tensor, mask: Tensor, tau_seq: float) -> Tensor:
    """[..., T] true at t >= 1 where cos(F_t, F_{t-1}) >= tau_seq and both positions are valid:
    C(c)'s test between a node and its parent, on a teacher-forced sequence (features
    [..., T, D]; leading axes, such as EAGLE-3's unrolled steps, are kept apart)."""
    feats = unit_states(features)
    valid = mask.bool()
    out = torch.zeros_like(valid)
    out[..., 1:] = ((feats[..., 1:, :] * feats[..., :-1, :]).sum(dim=-1) >= tau_seq) & valid[..., 1:] & valid[..., :-1]
    return out


@hookimpl
def train_loss(soft_ce: Tensor, regression: Tensor, features: Tensor, mask: Tensor, options: CascadeOptions) -> tuple[Tensor, Tensor]:
    convergent = convergent_positions(features, mask, options.tau_seq)
    return soft_ce * (1 + options.beta * convergent.to(soft_ce.dtype)), regression
