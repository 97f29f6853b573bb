"""Hypothesis strategies for the inputs of a decode step, and the ``RelaxCase`` bundle a
method's ``build_relaxed_dist`` and the ``accept`` hook can be called with.

Tensors come from torch generators seeded by hypothesis-drawn ints (fast to draw); the
shapes and the kinds of rows are drawn by hypothesis, so failures shrink to small trees
and few nodes.  Distributions look like what the sampling processors make: peaked and flat
softmax rows, rows cut by top-k / top-p (exact zeros), one-hot rows, near-uniform rows.
"""

from __future__ import annotations

import math

import attrs
import torch
from hypothesis import strategies as st
from torch import Tensor

from specimg.config import Sampling
from specimg.sampling import probabilities
from specimg.step import Scores
from specimg.tree import DraftTree

_ROW_KINDS = ("softmax", "softmax", "softmax", "peaked", "near-uniform", "one-hot")
_ROW_SCALES = {"softmax": 1.0, "peaked": 6.0, "near-uniform": 1e-3, "one-hot": 0.0}


@attrs.frozen(eq=False)
class EmbeddingTarget:
    """A target stand-in for relaxations: vocabulary, sizes, and input embeddings [V, D]."""

    embeddings: Tensor
    num_tokens: int = 16

    @property
    def vocab_size(self) -> int:
        return self.embeddings.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embeddings.shape[1]

    def input_embeddings(self) -> Tensor:
        return self.embeddings


@attrs.frozen(eq=False)
class CodebookTokenizer:
    """A tokenizer stand-in: the code vectors [V, d] the decoder would see."""

    codebook: Tensor

    @property
    def vocab_size(self) -> int:
        return self.codebook.shape[0]

    def codebook_vectors(self) -> Tensor:
        return self.codebook

    raw_codebook_vectors = codebook_vectors  # this stand-in's decoder does not normalise them


@attrs.frozen(eq=False)
class RelaxCase:
    """One decode step's inputs: the tree, the target's scores on it (``scores.probs`` is p),
    the sampling that made p, and the target and tokenizer stand-ins."""

    tree: DraftTree
    scores: Scores
    sampling: Sampling
    target: EmbeddingTarget
    tokenizer: CodebookTokenizer

    @property
    def p(self) -> Tensor:
        return self.scores.probs

    @classmethod
    def of(cls, tree: DraftTree, probs: Tensor, sampling: Sampling = Sampling()) -> RelaxCase:
        """A hand-made case around target distributions ``probs`` [n, V]: each node's hidden
        state, each token's embedding and code are one-hot (nothing is similar)."""
        vocab = probs.shape[-1]
        hidden = torch.eye(vocab)[tree.tokens][None]
        return cls(tree, Scores(probs, hidden, probs.log()[None]), sampling, EmbeddingTarget(torch.eye(vocab)), CodebookTokenizer(torch.eye(vocab)))


def seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**32 - 1)


def deltas() -> st.SearchStrategy[float]:
    """Total-variation budgets, with the edges 0 and 1 and tiny ones."""
    return st.one_of(st.floats(0.0, 1.0), st.just(0.0), st.just(1.0), st.floats(0.0, 1e-3))


@st.composite
def budgets(draw: st.DrawFn, n: int) -> Tensor:
    """Per-node budgets [n] (float32, as the engine's fold makes them), zero at some nodes."""
    return torch.tensor(draw(st.lists(deltas(), min_size=n, max_size=n)))


@st.composite
def samplings(draw: st.DrawFn, vocab: int, greedy: bool | None = None) -> Sampling:
    """LlamaGen sampling settings: temperature (0 = greedy), top-k, top-p, CFG."""
    is_greedy = draw(st.booleans()) if greedy is None else greedy
    return Sampling(
        temperature=0.0 if is_greedy else draw(st.sampled_from([0.5, 1.0, 2.0])),
        top_k=draw(st.sampled_from([0, 0, 0, 0, vocab - 1, 1])),
        top_p=draw(st.sampled_from([1.0, 1.0, 1.0, 1.0, 0.9, 0.5])),
        cfg_scale=draw(st.sampled_from([1.0, 1.5, 4.0])),
    )


@st.composite
def row_logits(draw: st.DrawFn, rows: int, n: int, vocab: int) -> Tensor:
    """Raw logits [rows, n, V]; each node's row is softmax-like, peaked, near-uniform, or a
    one-hot spike that survives any temperature and guidance."""
    g = torch.Generator().manual_seed(draw(seeds()))
    kinds = draw(st.lists(st.sampled_from(_ROW_KINDS), min_size=n, max_size=n))
    scale = torch.tensor([_ROW_SCALES[k] for k in kinds])[None, :, None]
    logits = torch.randn(rows, n, vocab, generator=g) * scale
    for node, kind in enumerate(kinds):
        if kind == "one-hot":
            logits[0, node, int(torch.randint(vocab, (), generator=g))] = 1e4
    return logits


@st.composite
def trees(draw: st.DrawFn, vocab: int, max_nodes: int = 6, max_children: int = 3, sampled: bool = False) -> DraftTree:
    """A draft tree: random shape (parents precede children), children's tokens distinct,
    taken as the drafter's top ones (in draft-rank order) or, for ``sampled`` trees, drawn
    without replacement from the drafter's distribution at their parent (Gumbel-top-k, as
    the core's builders do), which is then kept in ``draft_probs``."""
    n = draw(st.integers(1, max_nodes))
    parents = [-1]
    for node in range(1, n):
        parents.append(draw(st.sampled_from([u for u in range(node) if parents.count(u) < min(max_children, vocab)])))
    g = torch.Generator().manual_seed(draw(seeds()))
    draft = probabilities(draw(row_logits(1, n, vocab)), Sampling())
    draft = torch.where(draft > 0, draft, 1e-3)  # every child needs mass under its parent's draft
    draft = draft / draft.sum(-1, keepdim=True)
    children = [[c for c in range(1, n) if parents[c] == u] for u in range(n)]
    tokens = [int(torch.randint(vocab, (), generator=g))] + [0] * (n - 1)
    for u, kids_of_u in enumerate(children):
        keys = draft[u].log()
        if sampled:
            keys = keys - (-torch.rand(vocab, generator=g).clamp_(min=1e-20).log()).log()
        for child, token in zip(kids_of_u, keys.topk(len(kids_of_u)).indices.tolist()):
            tokens[child] = token
    logprobs = [0.0] + [math.log(float(draft[parents[c], tokens[c]])) for c in range(1, n)]
    draft_probs = torch.where(torch.tensor([bool(c) for c in children])[:, None], draft, 0.0) if sampled else None
    return DraftTree.from_parents(tokens, parents, logprobs, draft_probs=draft_probs, sampled=sampled)


@st.composite
def hidden_states(draw: st.DrawFn, rows: int, n: int, dim: int) -> Tensor:
    """Hidden states [rows, n, D]; some nodes copy or nearly copy an earlier node's state,
    so similarity thresholds (e.g. CASCADE's) are met as well as missed."""
    g = torch.Generator().manual_seed(draw(seeds()))
    hidden = torch.randn(rows, n, dim, generator=g)
    for node in range(1, n):
        kind = draw(st.sampled_from(["fresh", "copy", "near"]))
        if kind != "fresh":
            source = draw(st.integers(0, node - 1))
            noise = 0.0 if kind == "copy" else 0.05
            hidden[:, node] = hidden[:, source] + noise * torch.randn(rows, dim, generator=g)
    return hidden


@st.composite
def relax_cases(
    draw: st.DrawFn,
    vocab: st.SearchStrategy[int] = st.integers(2, 8),
    max_nodes: int = 8,
    max_children: int = 3,
    sampled: bool = False,
    greedy: bool | None = None,
) -> RelaxCase:
    """A complete decode step to relax and accept: tree, scores (p after the drawn sampling
    settings, hidden states, raw logits), target and tokenizer stand-ins."""
    v = draw(vocab)
    tree = draw(trees(v, max_nodes, max_children, sampled))
    sampling = draw(samplings(v, greedy))
    rows = 2 if sampling.cfg else 1
    logits = draw(row_logits(rows, tree.size, v))
    dim = draw(st.integers(2, 8))
    scores = Scores(probabilities(logits, sampling), draw(hidden_states(rows, tree.size, dim)), logits)
    target = EmbeddingTarget(draw(hidden_states(1, v, dim))[0])  # token embeddings and codes: some (nearly) duplicates
    return RelaxCase(tree, scores, sampling, target, CodebookTokenizer(draw(hidden_states(1, v, draw(st.integers(2, 8))))[0]))


@st.composite
def relax_batches(
    draw: st.DrawFn, images: st.SearchStrategy[int] = st.integers(2, 3), max_nodes: int = 8, max_children: int = 3, sampled: bool = False
) -> list[RelaxCase]:
    """Several images' decode steps for one batch: each image its own tree, scores and
    hidden states; one vocabulary, sampling, target and tokenizer."""
    first = draw(relax_cases(max_nodes=max_nodes, max_children=max_children, sampled=sampled))
    rows, _, dim = first.scores.hidden.shape
    vocab = first.p.shape[-1]
    batch = [first]
    for _ in range(draw(images) - 1):
        tree = draw(trees(vocab, max_nodes, max_children, sampled))
        logits = draw(row_logits(rows, tree.size, vocab))
        batch.append(attrs.evolve(first, tree=tree, scores=Scores(probabilities(logits, first.sampling), draw(hidden_states(rows, tree.size, dim)), logits)))
    return batch
