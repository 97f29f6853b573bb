"""Codebook neighbour tables: exact top-k, and cached once per codebook."""

from __future__ import annotations

import pytest
import torch

from specimg import SpecimgError, neighbours
from specimg.neighbours import codebook_donors, embedding_donors, nearest_codes, neighbour_table


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(neighbours.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(neighbours, "_memory", {})
    return tmp_path


def codebook(size: int = 40, dim: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(size, dim, generator=torch.Generator().manual_seed(seed))


def test_table_is_the_brute_force_top_k():
    book = codebook()
    dist = (book[:, None, :].double() - book[None, :, :].double()).pow(2).sum(-1)
    dist.fill_diagonal_(float("inf"))
    expected = dist.argsort(dim=1)[:, :7].to(torch.int32)
    for chunk in (1, 6, 64):  # row chunks never change the answer
        assert torch.equal(nearest_codes(book, 7, chunk_rows=chunk), expected)
    assert nearest_codes(book, 1000).shape == (40, 39)


def test_table_is_built_once_then_read_from_disk(fresh_cache, monkeypatch):
    book = codebook()
    first = neighbour_table(book, 5)
    files = list(fresh_cache.glob("neighbours-*-k5.pt"))
    assert len(files) == 1 and not list(fresh_cache.glob("*.tmp"))

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached table should have been used")

    monkeypatch.setattr(neighbours, "nearest_codes", no_rebuild)
    monkeypatch.setattr(neighbours, "_memory", {})
    assert torch.equal(neighbour_table(book.clone(), 5), first)  # from the file
    files[0].unlink()
    assert torch.equal(neighbour_table(book, 5), first)  # from memory
    with pytest.raises(AssertionError, match="cached table"):
        neighbour_table(book + 1e-3, 5)  # another codebook is another table


def test_unreadable_cache_entry_is_rebuilt(fresh_cache):
    book = codebook()
    first = neighbour_table(book, 4)
    path = next(fresh_cache.glob("neighbours-*-k4.pt"))
    path.write_bytes(b"not a tensor")
    neighbours._memory.clear()
    assert torch.equal(neighbour_table(book, 4), first)
    torch.save(torch.full_like(first, 99999), path)  # the right shape and type, codes outside the codebook
    neighbours._memory.clear()
    assert torch.equal(neighbour_table(book, 4), first)


class Tokenizer:
    def __init__(self, book: torch.Tensor):
        self.book = book

    def codebook_vectors(self) -> torch.Tensor:
        return self.book


def test_donors_are_the_candidates_neighbours():
    book = codebook()
    table = nearest_codes(book, 3).long()
    candidates = torch.tensor([[5, 9], [2, -1]])
    donors = codebook_donors(Tokenizer(book), candidates, 3, 40, "lantern")
    assert torch.equal(donors[0, 0], table[5]) and torch.equal(donors[1, 0], table[2])
    assert bool((donors[1, 1] == -1).all())
    with pytest.raises(SpecimgError, match="needs the image tokenizer's codebook"):
        codebook_donors(None, candidates, 3, 40, "lantern")
    with pytest.raises(SpecimgError, match="40 codes, the target's vocabulary 64"):
        codebook_donors(Tokenizer(book), candidates, 3, 64, "lantern")


class EmbeddingTarget:
    def __init__(self, table: torch.Tensor):
        self.table = table

    def input_embeddings(self) -> torch.Tensor:
        return self.table


def test_embedding_donors_are_the_nearest_by_cosine(fresh_cache):
    emb = codebook() * torch.linspace(0.5, 3.0, 40)[:, None]  # lengths vary: only directions count
    unit = torch.nn.functional.normalize(emb, dim=-1)
    cos = unit @ unit.T
    cos.fill_diagonal_(-2.0)
    candidates = torch.tensor([[5, 9], [2, -1]])
    donors = embedding_donors(EmbeddingTarget(emb), candidates, 4)
    for row, col in ((0, 0), (0, 1), (1, 0)):
        assert torch.equal(donors[row, col], cos[candidates[row, col]].topk(4).indices)
    assert bool((donors[1, 1] == -1).all())
