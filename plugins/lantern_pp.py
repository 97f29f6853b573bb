"""lantern++: LANTERN++ (Park et al., 2025), static tree drafting plus a relative cap.

Dynamic trees stay shallow on image targets: the drafter's confidence is low everywhere,
so cumulative draft probabilities fall fast.  LANTERN++ fixes the tree's shape in advance
(rank paths over the drafter's top-k, Medusa-style) and relaxes acceptance with a cap
relative to the target's own probability.  Per tree node u, for each child c of u in
draft-rank order:

    B_k(c)  = the k codes nearest to c in the tokenizer's codebook (nearest first)
    q_R(c) += whole neighbours of B_k(c), while q_R(c) <= lam * p_u(c) and the node's
              budget delta lasts

A token the target finds unlikely stays unlikely: the cap scales with p_u(c).  The paper
has the cap alone; delta = 1 is that rule (no node can move more than its mass off the
candidates), and the default 0.1 adds the TVD budget every other method keeps.

``mode="paper"`` is the rule of the released code (LANTERN++ is the lambda mode of
jadohu/LANTERN's code, ``lantern_delta > 1``), neighbours in the raw codebook, no TVD
budget (``LanternPPOptions.budgeted`` is False): the instruction its script runs is
LlamaGen with ``--static_tree``, whose drafts are sampled from the drafter and verified by
``evaluate_posterior_v1`` (models/ea_model_llamagen.py).  Its tree, unless named, is the
release's default ``mc_sim_7b_63``.  For each drawn child x, r the node's residual and q
the drafter's distribution without the earlier siblings:

    A(x)    = the longest prefix of B_k(x) with r(A(x)) <= (lam - 1) * r(x)
    accept x with probability min(1, (r(x) + r(A(x))) / q(x))
    else      r <- norm(max(0, r - q'))  with q' = q with ALL of B_{k+1}(x) set to 0 where
                   A(x) is not empty (the codes are zeroed in the subtracted q, not in r);
                   uniform where nothing is left;   q <- norm(q without x)
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable
from typing import Any

import attrs
import torch
from attrs import validators as v
from torch import Tensor

from specimg import (
    CODEBOOKS, DraftSession, DraftTree, MethodSpec, TreeConfig, build_static, codebook_donors, hookimpl, transfer,
)
from specimg_plugins.lantern import MODES, released_law

RankPaths = tuple[tuple[int, ...], ...]


def likely_paths(size: int, first: float = 0.7, decay: float = 0.6, width: int = 10) -> RankPaths:
    """The ``size`` most likely rank paths if the drafter's rank-r token is accepted with
    probability ``first * decay**r`` independently per depth: how Medusa's trees are
    chosen, best first, so every path's parent and previous sibling are included."""
    accept = [first * decay**r for r in range(width)]
    frontier: list[tuple[float, tuple[int, ...]]] = [(-accept[0], (0,))]
    paths: list[tuple[int, ...]] = []
    while frontier and len(paths) < size:
        score, path = heapq.heappop(frontier)
        paths.append(path)
        heapq.heappush(frontier, (score * accept[0], path + (0,)))
        if path[-1] + 1 < width:
            heapq.heappush(frontier, (score / accept[path[-1]] * accept[path[-1] + 1], path[:-1] + (path[-1] + 1,)))
    return tuple(paths)


MC_SIM_7B_63: RankPaths = (
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)
"""EAGLE's ``mc_sim_7b_63`` (its model/choices.py), the static tree LANTERN's release
drafts by default (``initialize_tree_v1``): 25 paths, depth 5, 4 root children."""

TREES: dict[str, RankPaths] = {
    "default": likely_paths(59),  # 60 nodes with the root, 7 deep, up to 5 children
    "small": likely_paths(15),  # 16 nodes with the root, 5 deep
    "chain": tuple((0,) * d for d in range(1, 7)),  # the drafter's top choice, 6 deep
    "mc_sim_7b_63": MC_SIM_7B_63,
}
PAPER_TREE = "mc_sim_7b_63"
SETTINGS = ((5.0, 10), (10.0, 5), (20.0, 5))
"""(lam, k) of the three runs in the release's run.sh."""


@functools.lru_cache(maxsize=None)
def sized_paths(nodes: int) -> RankPaths:
    """The static tree of ``nodes`` nodes (the root included): the likeliest rank paths."""
    return likely_paths(nodes - 1)


@attrs.frozen
class LanternPPOptions:
    """k: codebook neighbours per token; lam: cap on q_R(c) / p(c); delta: TVD budget per
    node (1: none, the paper's cap-only rule); tree: the static tree's name (see TREES), or
    auto: the likeliest paths, as many nodes as the run's tree has (with auto trees, the
    size the machine's cost model picks); codebook: neighbours in the vectors the decoder
    sees or in the raw codebook (the released code's).  mode: "specimg" (the above) or
    "paper" (the released code's rule, module docstring: k, lam and tree as given, auto
    being the release's mc_sim_7b_63, drafts sampled, the raw codebook; delta and codebook
    are refused, since it does not use them)."""

    k: int = attrs.field(default=10, validator=v.ge(1))
    lam: float = attrs.field(default=5.0, validator=v.ge(1.0))
    delta: float = 0.1
    tree: str = attrs.field(default="auto", validator=v.in_(("auto", *TREES)))
    codebook: str = attrs.field(default="normalised", validator=v.in_(CODEBOOKS))
    mode: str = attrs.field(default="specimg", validator=v.in_(MODES))

    def ignores(self) -> tuple[str, tuple[str, ...]]:
        """The options this mode does not use (given, they are refused)."""
        return f"mode={self.mode}", ("delta", "codebook") if self.mode == "paper" else ()

    def released_tree(self, tree: TreeConfig) -> TreeConfig:
        """In paper mode, the static tree drawn from the drafter, as the release's
        ``--static_tree`` drafts (``topK_genrate_v1`` samples): its rule needs the drafter's q."""
        if self.mode != "paper":
            return tree
        return TreeConfig("static", rank_paths=self.paths(tree), sample=True, ar_fallback=tree.ar_fallback)

    def paths(self, tree: TreeConfig) -> RankPaths:
        """The static tree's rank paths: the named one, else (auto) the release's in paper
        mode and the likeliest ``tree.total_tokens`` nodes otherwise."""
        if self.tree != "auto":
            return TREES[self.tree]
        return TREES[PAPER_TREE] if self.mode == "paper" else sized_paths(tree.total_tokens)

    @property
    def node_delta(self) -> float:
        """The TVD the stack may spend at a node for this method: delta, or 1 for the
        paper's rule, which has no budget."""
        return 1.0 if self.mode == "paper" else self.delta

    @property
    def budgeted(self) -> bool:
        """Whether every node stays within delta in TVD (the released rule has no budget)."""
        return self.mode == "specimg"


@hookimpl
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    register(MethodSpec(
        "lantern++", LanternPPOptions, "LANTERN++: static draft tree, codebook neighbours, cap lam * p",
        paper={"mode": "paper", "tree": PAPER_TREE},
        departures=(
            "the paper has the cap lam * p alone; specimg's default adds a TVD budget of delta 0.1 per node. The release's run.sh "
            "runs " + ", ".join(f"lam {lam:g} / k {k}" for lam, k in SETTINGS) + " (-o lantern++.lam=... -o lantern++.k=...); "
            "the defaults are the first. mode=paper samples its drafts from the drafter, as the release's static tree does"
        ),
        batch=True,
    ))


@hookimpl
def propose_tree(
    session: DraftSession, root_token: int, tree_config: TreeConfig, max_depth: int, generator: torch.Generator, options: LanternPPOptions
) -> DraftTree:
    return build_static(session, root_token, options.paths(tree_config), tree_config.sample, generator, max_depth=max_depth)


@hookimpl
def build_relaxed_dist(
    dist: Tensor, target_dist: Tensor, budget: Tensor, tree: DraftTree, tokenizer: Any, options: LanternPPOptions
) -> Tensor:
    candidates = tree.candidates()[0].to(dist.device)
    raw = options.mode == "paper" or options.codebook == "raw"
    if options.mode == "paper":  # k nearest for A(x), k + 1 for what a rejection zeroes
        near = codebook_donors(tokenizer, candidates, options.k + 1, target_dist.shape[-1], "lantern++", raw=True)
        return released_law(dist, target_dist, budget, tree, near, options.k, lambda mass: (options.lam - 1) * mass, "lantern++", zero_in_q=True)
    donors = codebook_donors(tokenizer, candidates, options.k, target_dist.shape[-1], "lantern++", raw=raw)
    cap = options.lam * target_dist.gather(1, candidates.clamp(min=0))
    return transfer(dist, target_dist, candidates, donors, budget.to(dist.device), cap=cap, whole=True, distinct=True)[0]
