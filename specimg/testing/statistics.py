"""End-to-end statistical checks: the engine on Markov toy models, whose output law can be
enumerated exactly (V^T sequences).

Seeds are fixed, so each check passes or fails every time; its false-failure rate
``alpha`` is the chance that a correct engine fails with a seed picked at random.
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import Tensor

from specimg.config import Sampling, TreeConfig
from specimg.costmodel import CostModel
from specimg.engine import Engine
from specimg.relax import tvd
from specimg.sampling import cfg_active_at, probabilities
from specimg.step import Acceptance, Scores
from specimg.testing.markov import MarkovDrafter, MarkovTarget
from specimg.testing.strategies import CodebookTokenizer
from specimg.tree import DraftTree

IMAGES = 2000
"""Images per statistical check: 3 tokens each, a few seconds on one CPU thread."""
ALPHA = 1e-4
"""False-failure rate of each statistical check."""
SAMPLING = Sampling(cfg_scale=2.0, cfg_interval=0)
"""Guidance on image tokens 0 and 1 and off from token 2 on: both CFG paths are covered."""
TREE = TreeConfig(depth=2, topk=2, total_tokens=5)
"""A small EAGLE-2 tree that branches: 2 children at the root, 2 more below the best."""


@attrs.frozen(eq=False)
class MarkovProblem:
    target: MarkovTarget
    drafter: MarkovDrafter
    tokenizer: CodebookTokenizer


def markov_problem(seed: int, vocab: int = 3, num_tokens: int = 3, dim: int = 4) -> MarkovProblem:
    """Random target tables (conditional and unconditional differ, so CFG matters), a drafter
    with its own table (so drafts are often wrong), and token features and codes in which
    tokens 0 and 1 nearly coincide (so CASCADE, GSD and LANTERN find donors)."""
    g = torch.Generator().manual_seed(seed)

    def logits(*shape: int) -> Tensor:
        return 1.5 * torch.randn(*shape, generator=g)

    def vectors() -> Tensor:
        out = torch.randn(vocab, dim, generator=g)
        out[1] = out[0] + 0.05 * torch.randn(dim, generator=g)
        return out

    target = MarkovTarget(logits(vocab, vocab), logits(vocab), num_tokens, vectors(), logits(vocab, vocab), logits(vocab))
    return MarkovProblem(target, MarkovDrafter(logits(vocab, vocab)), CodebookTokenizer(vectors()))


def next_token_laws(target: MarkovTarget, sampling: Sampling) -> tuple[Tensor, Tensor]:
    """The AR law of a Markov target as the engine samples it: p(x_0) [V] and
    p(x_t | x_{t-1}) [T-1, V, V] (previous token first), after CFG (on or off per token
    index), temperature, top-k and top-p."""
    vocab = target.vocab_size
    first = probabilities(target.prefill(0, sampling.cfg).logits, sampling)[0]
    prev = torch.arange(vocab)
    logits = target.forward_tree(prev, torch.zeros(vocab, dtype=torch.long), torch.eye(vocab, dtype=torch.bool)).logits
    index = [torch.full((vocab,), t) for t in range(1, target.num_tokens)]
    steps = torch.stack([probabilities(logits, sampling, cfg_active_at(i, sampling)) for i in index])
    return first.double(), steps.double()


def sequence_law(first: Tensor, steps: Tensor) -> Tensor:
    """The probability of every token sequence, [V] * T."""
    law = first
    for step in steps:
        law = law[..., None] * step
    return law


def chi_square_pvalue(observed: Tensor, expected: Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square test of counts against expected counts (same total).  Bins
    expected below ``min_expected`` are pooled (with the smallest other bin if the pool is
    still too small); a count in a bin whose expectation is 0 gives p = 0."""
    observed, expected = observed.double().flatten(), expected.double().flatten()
    if bool((observed[expected == 0] > 0).any()):
        return 0.0
    small = expected < min_expected
    o = torch.cat([observed[~small], observed[small].sum()[None]])
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    if e[-1] < min_expected and len(e) > 2:
        j = int(e[:-1].argmin())
        o[j], e[j] = o[j] + o[-1], e[j] + e[-1]
        o, e = o[:-1], e[:-1]
    o, e = o[e > 0], e[e > 0]
    df = len(e) - 1
    if df == 0:
        return 1.0
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def exact_law_pvalue(engine: Engine, images: int = IMAGES, seed: int = 0) -> float:
    """Generate ``images`` images and test their token sequences against the target's AR
    law (all V^T sequences enumerated) with Pearson's chi-square."""
    tokens = engine.generate([0] * images, seed=seed).tokens
    vocab, length = engine.target.vocab_size, tokens.shape[1]
    law = sequence_law(*next_token_laws(engine.target, engine.sampling))
    index = (tokens * vocab ** torch.arange(length - 1, -1, -1)).sum(1)
    return chi_square_pvalue(torch.bincount(index, minlength=vocab**length), images * law)


def check_exact_law(engine: Engine, images: int = IMAGES, seed: int = 0, alpha: float = ALPHA) -> None:
    """The images follow the AR law: the chi-square test does not reject at ``alpha``."""
    pvalue = exact_law_pvalue(engine, images, seed)
    assert pvalue >= alpha, f"{engine.method}: {images} images do not follow the AR law (chi-square p = {pvalue:.3g} < {alpha})"


def tvd_tolerance(samples: int, vocab: int, alpha: float) -> float:
    """t with P(TVD(empirical, true) >= t) <= alpha for ``samples`` i.i.d. draws over
    ``vocab`` tokens: Weissman et al. (2003), P(|p^ - p|_1 >= e) <= (2^V - 2) exp(-m e^2 / 2)."""
    return math.sqrt(math.log(max(2**vocab - 2, 1) / alpha) / (2 * samples))


def check_within_delta(engine: Engine, images: int = IMAGES, seed: int = 0, alpha: float = ALPHA) -> None:
    """Each token's empirical law given the previous token (per position) is within the
    stack's delta of the target's, plus ``tvd_tolerance`` at ``alpha`` split over the cells
    (Bonferroni).  Given the previous token, the images' next tokens are i.i.d. draws of a
    mixture of the q_R the engine used, each within delta of p, so the mixture is too."""
    assert engine.stack is not None
    tokens = engine.generate([0] * images, seed=seed).tokens
    vocab, length = engine.target.vocab_size, tokens.shape[1]
    first, steps = next_token_laws(engine.target, engine.sampling)
    cells = [(0, -1, torch.ones(images, dtype=torch.bool), first)]
    cells += [(t, a, tokens[:, t - 1] == a, steps[t - 1, a]) for t in range(1, length) for a in range(vocab)]
    for t, prev, rows, law in cells:
        count = int(rows.sum())
        if count == 0:
            continue
        empirical = torch.bincount(tokens[rows, t], minlength=vocab).double() / count
        bound = engine.stack.delta + tvd_tolerance(count, vocab, alpha / len(cells))
        distance = float(tvd(empirical, law))
        assert distance <= bound, (
            f"{engine.method}: token {t} after token {prev}: TVD {distance:.4f} to the target's law exceeds delta + tolerance = {bound:.4f} ({count} samples)"
        )


def flat_costs(nodes: int = 8) -> CostModel:
    """A made-up machine on which any tree of up to ``nodes`` nodes verifies in one AR
    step's time and drafting is nearly free: auto trees grow branching trees of that size,
    whatever the machine that runs the test."""
    table = tuple((n, 1.0 if n <= nodes else 100.0 * n) for n in (1, nodes, nodes + 1, 128))
    widths = tuple((k, 0.01) for k in (1, 10))
    return CostModel("flat", "a made-up machine", table, widths, widths, 0.01, 0.0, 1.0)


def accept_resampling_from_p(tree: DraftTree, scores: Scores, generator: torch.Generator) -> Acceptance:
    """A known-wrong acceptance rule for power tests: a chain of sampled drafts accepted with
    min(1, p / q), but the correction drawn from p instead of the residual norm(max(p - q, 0))
    (the classic bug).  An exactness test must reject its law."""
    p, path, node = scores.probs, [0], 0
    while tree.children[node]:
        child = tree.children[node][0]
        if torch.rand((), generator=generator) * tree.logprobs[child].exp() > p[node, tree.tokens[child]]:
            break
        path.append(child)
        node = child
    return Acceptance(path, int(torch.multinomial(p[node], 1, generator=generator)))
