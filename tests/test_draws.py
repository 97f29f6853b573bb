"""Tokens drawn as ``torch.multinomial`` draws them, without its checks: the engine's AR
steps and a batch's rows draw this way, and naive's walk keeps AR's draws seed for seed
only if the two draw alike."""

from __future__ import annotations

import pytest
import torch

from specimg.sampling import draw_rows


def _distributions(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Peaked random distributions (a few tokens hold most of the mass, as an image model's do)."""
    weights = torch.rand(rows, vocab, dtype=dtype, generator=torch.Generator().manual_seed(seed)) ** 8
    return weights / weights.sum(dim=-1, keepdim=True)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("vocab", [2, 64, 16384])
def test_a_draw_is_multinomials_token_and_leaves_its_generator_state(vocab, dtype, device):
    for seed in range(16):
        probs = _distributions(1, vocab, dtype, seed)[0].to(device)
        mine, theirs = torch.Generator(device).manual_seed(seed), torch.Generator(device).manual_seed(seed)
        for _ in range(3):  # the states stay in step draw after draw
            assert torch.equal(draw_rows(probs[None], [mine]), torch.multinomial(probs, 1, generator=theirs))
            assert torch.equal(mine.get_state(), theirs.get_state())


@pytest.mark.parametrize("device", DEVICES)
def test_each_row_draws_from_its_own_generator_as_it_would_alone(device):
    probs = _distributions(5, 512, torch.float32, seed=3).to(device)
    mine = [torch.Generator(device).manual_seed(10 + i) for i in range(5)]
    theirs = [torch.Generator(device).manual_seed(10 + i) for i in range(5)]
    drawn = draw_rows(probs, mine)
    assert drawn.shape == (5,)
    assert torch.equal(drawn, torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, theirs)]))
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(mine, theirs))
    with pytest.raises(ValueError):
        draw_rows(probs, mine[:4])
