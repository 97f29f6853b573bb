"""gsd: Grouped Speculative Decoding (So et al., ICCV 2025), made tree-aware.

Image targets spread their mass over groups of visually interchangeable tokens, and which
tokens group together depends on the context, so the groups are formed per node from the
target's own distribution rather than from a fixed clustering.  Per tree node u, for each
child c of u in draft-rank order:

    G(c)    = tokens t within +-w ranks of c in p_u's order with
              |p_u(t) - p_u(c)| < p_thr  and  cos(E_t, E_c) >= emb_thr
              (E = the target's input embeddings), closest in rank first
    q_R(c) += mass of G(c) under p_u, while the node's budget delta lasts

The paper's own rule (``acceptance="group"``) verifies a chain of drafts x_i ~ q_i (SJD's
windows) with no budget:

    accept x_i with probability min(1, p_i({x_i} + G(x_i)) / q_i({x_i} + G(x_i)))
    at the first rejection, emit y ~ norm(max(0, p_i - q_i)) and stop
    (the whole chain accepted: emit y ~ p at its last node)

``mode="paper"`` is that rule with the released code's groups (junhyukso/GSD): the tokens
at positions [r-w, r+w) of p_u's ascending order, r the draft's position (cut off at the
top; none at all when r < w, where the release's slice is empty), with
|p_u(t) - p_u(x)| < p_thr and squared L2 distance of the target's raw input embeddings
(its LM embedding table, as the release's ``embed_tokens.weight``) < emb_thr.  It has no
TVD budget (``GSDOptions.budgeted`` is False).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
from attrs import validators as v
from torch import Tensor

from specimg import Acceptance, DraftTree, MethodSpec, Sampling, SpecimgError, Target, candidate_rows, chain_acceptance, hookimpl, transfer


@attrs.frozen
class GSDOptions:
    """w: rank window; p_thr: largest probability gap to c; emb_thr: smallest cosine
    similarity of input embeddings to c (scale-free, unlike the paper's squared L2 < 0.5,
    which is tied to Lumina-mGPT's embedding scale); delta: TVD budget per node.
    acceptance: "budget" moves G(c)'s mass onto c within delta (any tree); "group" is the
    paper's group acceptance on sampled chains, unbounded (delta 0 turns grouping off).
    mode: "specimg" (the above) or "paper" (group acceptance with the released code's
    groups; emb_thr is then the squared-L2 bound, the paper's 0.5)."""

    w: int = attrs.field(default=7, validator=v.ge(1))
    p_thr: float = 0.15
    emb_thr: float = 0.5
    delta: float = 0.5
    acceptance: str = attrs.field(default="budget", validator=v.in_(("budget", "group")))
    mode: str = attrs.field(default="specimg", validator=v.in_(("specimg", "paper")))

    def ignores(self) -> tuple[str, tuple[str, ...]]:
        """The options this mode does not use (given, they are refused)."""
        return f"mode={self.mode}", ("acceptance",) if self.mode == "paper" else ()

    @property
    def budgeted(self) -> bool:
        """Whether every node stays within delta in TVD (the group rules have no budget)."""
        return self.mode == "specimg" and self.acceptance == "budget"


@hookimpl
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    register(MethodSpec(
        "gsd", GSDOptions, "GSD: candidates take the mass of nearby-ranked, similar tokens, grouped per node",
        stacked_defaults={"sjd": {"mode": "paper"}},  # on sjd's chains, GSD as published
        paper={"mode": "paper"},
        departures=(
            "alone, on a drafter's trees, gsd keeps a TVD budget (its groups' mass moves onto the draft within delta); the paper's "
            "group test has no budget and verifies sjd's chains only, so it is the default beside sjd (sjd+gsd)"
        ),
        batch=True,
    ))


@hookimpl
def build_relaxed_dist(
    dist: Tensor, target_dist: Tensor, budget: Tensor, tree: DraftTree, target: Target, options: GSDOptions
) -> Tensor | None:
    if not options.budgeted:  # the groups act in the acceptance, not on q_R
        return None
    candidates = tree.candidates()[0].to(dist.device)
    donors = group_donors(target_dist, candidates, target.input_embeddings(), options)
    return transfer(dist, target_dist, candidates, donors, budget.to(dist.device), distinct=True)[0]


def group_donors(probs: Tensor, candidates: Tensor, embeddings: Tensor, options: GSDOptions) -> Tensor:
    """G(c) for every candidate at once: donors [n, C, 2w], -1 where none.  The nodes of
    ``candidate_rows`` are ranked (one sort of their rows)."""
    vocab = probs.shape[-1]
    donors = torch.full((*candidates.shape, 2 * options.w), -1, dtype=torch.long, device=probs.device)
    rows = candidate_rows(candidates)
    p, cand = probs[rows], candidates[rows]
    safe = cand.clamp(min=0)
    order = p.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(vocab, device=p.device).expand_as(order))
    steps = torch.arange(1, options.w + 1, device=p.device)
    offsets = torch.stack([-steps, steps], dim=1).flatten()  # -1, +1, -2, +2, ...: closest rank first, likelier side first
    pos = rank.gather(1, safe)[..., None] + offsets
    inside = (pos >= 0) & (pos < vocab)
    tokens = order.gather(1, pos.clamp(0, vocab - 1).flatten(1)).view_as(pos)
    p_close = (p.gather(1, tokens.flatten(1)).view_as(tokens) - p.gather(1, safe)[..., None]).abs() < options.p_thr
    emb = embeddings.to(p.device)
    e_cand = F.normalize(emb[safe].float(), dim=-1)
    e_tok = F.normalize(emb[tokens].float(), dim=-1)
    e_close = torch.einsum("mcd,mckd->mck", e_cand, e_tok) >= options.emb_thr
    keep = inside & p_close & e_close & (cand >= 0)[..., None]
    donors[rows] = torch.where(keep, tokens, torch.full_like(tokens, -1))
    return donors


def released_group_donors(probs: Tensor, candidates: Tensor, embeddings: Tensor, options: GSDOptions) -> Tensor:
    """The released code's G(x) for every candidate: donors [n, C, 2w - 1], -1 where none
    (module docstring; x itself, at offset 0, is not a donor).  A draft among the w least
    likely tokens has none: the release slices the sorted ids with [r - w : r + w], whose
    negative start leaves the slice empty, and its empty group falls to the plain test
    p(x) / q(x) (junhyukso/GSD scheduler/jacobi_iteration_lumina_mgpt.py:305-337)."""
    vocab = probs.shape[-1]
    safe = candidates.clamp(min=0)
    order = probs.argsort(dim=1, stable=True)  # ascending, as the released code sorts logits
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(vocab, device=probs.device).expand_as(order))
    offsets = torch.cat([torch.arange(-options.w, 0), torch.arange(1, options.w)]).to(probs.device)
    centre = rank.gather(1, safe)[..., None]
    pos = centre + offsets
    inside = (pos < vocab) & (centre >= options.w)  # the top end is cut off; a start below 0 empties the window
    tokens = order.gather(1, pos.clamp(0, vocab - 1).flatten(1)).view_as(pos)
    p_close = (probs.gather(1, tokens.flatten(1)).view_as(tokens) - probs.gather(1, safe)[..., None]).abs() < options.p_thr
    emb = embeddings.to(probs.device).float()
    e_close = (emb[tokens] - emb[safe][..., None, :]).square().sum(-1) < options.emb_thr
    keep = inside & p_close & e_close & (candidates >= 0)[..., None]
    return torch.where(keep, tokens, torch.full_like(tokens, -1))


@hookimpl
def accept(
    tree: DraftTree, dist: Tensor, sampling: Sampling, generator: torch.Generator, exact: bool, target: Target, options: GSDOptions
) -> Acceptance | None:
    if options.budgeted or sampling.greedy or exact:  # delta 0: no groups, the core's speculative sampling
        return None
    return group_acceptance(tree, dist, target.input_embeddings(), generator, options)


def group_acceptance(
    tree: DraftTree, probs: Tensor, embeddings: Tensor, generator: torch.Generator, options: GSDOptions, grouping: bool = True
) -> Acceptance:
    """GSD's acceptance along a chain of sampled drafts (module docstring).  Without
    ``grouping`` every group is the draft alone: speculative sampling, exact.  The walk is
    the core's ``chain_acceptance`` (one device program where host reads stall)."""
    if tree.draft_probs is None or tree.child_ids.shape[1] > 1:
        raise SpecimgError("gsd's group acceptance verifies a chain of sampled drafts (sjd's windows): use it as sjd+gsd")
    candidates, ids = (t.to(probs.device) for t in tree.candidates())
    group = candidates[..., None]
    if grouping:
        donors = released_group_donors if options.mode == "paper" else group_donors
        group = torch.cat([group, donors(probs, candidates, embeddings, options)], dim=-1)
    members = group[:, 0].clamp(min=0)
    inside = (group[:, 0] >= 0).to(probs.dtype)
    draft = tree.draft_probs.to(probs.device)
    p_group = (probs.gather(1, members) * inside).sum(1)
    q_group = (draft.gather(1, members) * inside).sum(1)
    ratio = torch.where(candidates[:, 0] >= 0, p_group / q_group.clamp(min=torch.finfo(q_group.dtype).tiny), 0.0)
    left = (probs - draft).clamp(min=0)
    # the chain's last node emits the bonus token from p; so does a node where p == q (rejection had probability 0)
    from_p = (ids[:, 0] < 0) | (left.sum(dim=1) <= 0)
    return chain_acceptance(tree, ratio, torch.where(from_p[:, None], probs, left), generator)
