"""The uncertainty measure reads the distributions the engine sampled from."""

import pytest
import torch

from specimg.config import Sampling, TreeConfig
from specimg.engine import Engine
from specimg.eval.uncertainty import sampled_uncertainty
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target

TINY = dict(dim=32, n_layer=2, n_head=4, multiple_of=16, vocab_size=48, num_classes=4, block_size=16)


@pytest.mark.parametrize("sampling", [Sampling(1.0, cfg_scale=3.0, top_k=12), Sampling(0.8, cfg_scale=1.0)])
def test_teacher_forced_distributions_are_the_ones_speculative_sampling_drew_from(sampling) -> None:
    """With delta 0 the engine's q_R at every node of an accepted path is the target's
    processed distribution at that position: the teacher-forced measure must equal it
    (after token 0, which the prefill draws; the last steps are the image's, earlier ones
    may come from the engine timing its first image)."""
    target = build_target("GPT-B", seed=0, **TINY)
    engine = Engine(target, build_drafter(target, seed=1), "naive", sampling=sampling, tree=TreeConfig(ar_fallback=False))  # every step drafts
    seen: list[torch.Tensor] = []
    engine.on_step = lambda tree, dist, path: seen.append(dist[torch.as_tensor(path)])
    tokens = engine.generate([2], seed=5).tokens
    drawn = torch.cat(seen)[-(tokens.shape[1] - 1) :]
    measured = sampled_uncertainty(target, torch.tensor([2]), tokens, sampling)
    torch.testing.assert_close(measured.top1[1:], drawn.max(-1).values, atol=1e-5, rtol=1e-4)
    entropy = -(drawn * drawn.clamp_min(1e-30).log()).sum(-1)
    torch.testing.assert_close(measured.entropy[1:], entropy, atol=1e-4, rtol=1e-4)
    if sampling.top_k:
        assert int(measured.codes_for_90.max()) <= sampling.top_k


def test_summary_of_a_uniform_target() -> None:
    """A target whose logits are all equal is as flat as a distribution can be."""
    target = build_target("GPT-B", seed=0, **TINY)
    torch.nn.init.zeros_(target.output.weight)
    tokens = torch.randint(0, TINY["vocab_size"], (3, TINY["block_size"]), generator=torch.Generator().manual_seed(0))
    summary = sampled_uncertainty(target, torch.tensor([0, 1, 3]), tokens, Sampling(1.0, cfg_scale=2.0)).summary()
    assert summary["positions"] == 3 * TINY["block_size"]
    assert summary["top1_p10_median_p90"] == [round(1 / 48, 4)] * 3
    assert summary["share_top1_at_most_0.1"] == 1.0 and summary["share_top1_below_0.05"] == 1.0
    assert summary["codes_for_90pct_median"] == 44  # ceil(0.9 * 48)
    assert sum(summary["top1_histogram"]) == sum(summary["entropy_histogram"]) == 3 * TINY["block_size"]
    assert summary["entropy_histogram"][-1] == 3 * TINY["block_size"]
