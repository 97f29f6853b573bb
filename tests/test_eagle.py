"""EAGLE drafters: tree expansion equals chains and rollback (both types); EAGLE-1's teacher
forcing and weights; save/load."""

from __future__ import annotations

import pytest
import torch

from specimg.errors import SpecimgError
from specimg.models.base import Drafter
from specimg.models import load_drafter
from specimg.models.eagle import EagleDrafter, build_drafter, save_drafter
from specimg.models.llamagen import LlamaGenTarget, build_target

TINY = dict(dim=64, n_layer=2, n_head=4, vocab_size=64, block_size=16, multiple_of=32, num_classes=10, initializer_range=0.1)
TINY_T2I = dict(TINY, model_type="t2i", cls_token_num=6, caption_dim=24)
ATOL = 1e-5


def path_to(node: int, parents: list[int]) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def setup(kind: str = "c2i", seed: int = 1, drafter: str = "eagle1") -> tuple[LlamaGenTarget, EagleDrafter]:
    target = build_target("GPT-B", **(TINY if kind == "c2i" else TINY_T2I))
    return target, build_drafter(target, seed=seed, kind=drafter)


def features(rows: int, m: int, seed: int, width: int = 64) -> torch.Tensor:
    return torch.randn(rows, m, width, generator=torch.Generator().manual_seed(seed))


def started(drafter: EagleDrafter, steps: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    drafter.prefill(3, cfg=True)
    for hidden, tokens in steps:
        logits = drafter.start(hidden, tokens)
    return logits


def committed(width: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(features(2, 1, 0, width), torch.tensor([5])), (features(2, 3, 1, width), torch.tensor([9, 2, 40]))]


COMMITTED = committed()
WIDTH = {"eagle1": 64, "eagle3": 3 * 64}
"""What start takes: the target's last hidden states (EAGLE-1), three layers' inputs (EAGLE-3)."""


@pytest.mark.parametrize("kind,drafter_type", [("c2i", "eagle1"), ("t2i", "eagle1"), ("c2i", "eagle3"), ("t2i", "eagle3")])
def test_tree_expansion_equals_sequential_chains(kind: str, drafter_type: str) -> None:
    target, drafter = setup(kind, drafter=drafter_type)
    assert isinstance(drafter, Drafter)
    COMMITTED = committed(WIDTH[drafter_type])
    root = started(drafter, COMMITTED)
    assert root.shape == (2, target.vocab_size) and root.dtype == torch.float32
    # drafter node i = tree node i, fed in batches whose parents were fed by earlier calls
    batches = ((1, 3), (3, 4), (4, 11))
    g = torch.Generator().manual_seed(5)
    parents = [-1] + [int(torch.randint(0, a, (1,), generator=g)) for a, b in batches for _ in range(a, b)]
    tokens = torch.randint(0, target.vocab_size, (11,), generator=g)
    tree_logits = torch.cat([drafter.expand(torch.tensor(parents[a:b]), tokens[a:b]) for a, b in batches], dim=1)
    assert tree_logits.shape == (2, 10, target.vocab_size)
    for node in range(1, 11):
        started(drafter, COMMITTED)
        path = path_to(node, parents)
        for fed, (parent, child) in enumerate(zip(path, path[1:])):
            chain = drafter.expand(torch.tensor([fed]), tokens[child : child + 1])  # the chain's nodes are 1, 2, ...
        torch.testing.assert_close(tree_logits[:, node - 1], chain[:, 0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("drafter_type", ["eagle1", "eagle3"])
def test_start_rolls_back_speculative_nodes(drafter_type: str) -> None:
    target, drafter = setup(drafter=drafter_type)
    _, fresh = setup(drafter=drafter_type)
    COMMITTED = committed(WIDTH[drafter_type])
    nxt = (features(2, 2, 7, WIDTH[drafter_type]), torch.tensor([11, 12]))
    started(drafter, COMMITTED)
    drafter.expand(torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3]))
    drafter.expand(torch.tensor([1, 3, 3]), torch.tensor([4, 5, 6]))
    a = drafter.start(*nxt)
    b = started(fresh, COMMITTED + [nxt])
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    for parents, tokens in (([0, 0], [3, 4]), ([2], [5])):
        step = (torch.tensor(parents), torch.tensor(tokens))
        torch.testing.assert_close(drafter.expand(*step), fresh.expand(*step), atol=ATOL, rtol=0)


def test_forward_train_equals_incremental_decoding() -> None:
    target, drafter = setup()
    feats, tokens = features(2, 6, 8), torch.tensor([5, 9, 2, 40, 7, 7])
    with torch.no_grad():
        pred, logits = drafter.forward_train(feats, tokens.expand(2, -1))
    assert pred.shape == (2, 6, 64) and logits.shape == (2, 6, target.vocab_size)
    drafter.prefill(3, cfg=True)
    for t in range(6):  # one pair per start
        torch.testing.assert_close(drafter.start(feats[:, t : t + 1], tokens[t : t + 1]), logits[:, t], atol=ATOL, rtol=0)
    drafter.prefill(3, cfg=True)  # several pairs per start
    torch.testing.assert_close(drafter.start(feats[:, :4], tokens[:4]), logits[:, 3], atol=ATOL, rtol=0)
    # a chain of expanded nodes: each node's feature is the drafter's own prediction at its parent
    drafter.prefill(3, cfg=True)
    drafter.start(feats[:, :1], tokens[:1])
    chain = [drafter.expand(torch.tensor([k]), tokens[k + 1 : k + 2])[:, 0] for k in range(4)]
    own = feats[:, :1]
    with torch.no_grad():
        for k in range(1, 6):
            pred, expected = drafter.forward_train(own, tokens[:k].expand(2, -1))
            own = torch.cat([feats[:, :1], pred], dim=1)
    for k, got in enumerate(chain):
        torch.testing.assert_close(got, expected[:, k + 1], atol=ATOL, rtol=0)


def test_training_touches_only_the_drafter() -> None:
    target, drafter = setup()
    names = set(dict(drafter.named_parameters()))
    assert names == {
        "fc.weight", "fc.bias",
        "layers.0.attention.wqkv.weight", "layers.0.attention.wo.weight",
        "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight", "layers.0.feed_forward.w3.weight",
        "layers.0.ffn_norm.weight",
    }  # no attention_norm: EAGLE-1's first layer has no input norm
    pred, logits = drafter.forward_train(features(2, 4, 9), torch.tensor([[1, 2, 3, 4]] * 2))
    logits.sum().backward()
    assert drafter.fc.weight.grad is not None
    assert target.output.weight.grad is None and target.tok_embeddings.weight.grad is None


@pytest.mark.parametrize("drafter_type", ["eagle1", "eagle3"])
def test_save_load_roundtrip(tmp_path, drafter_type: str) -> None:
    target, drafter = setup(seed=3, drafter=drafter_type)
    COMMITTED = committed(WIDTH[drafter_type])
    path = tmp_path / "drafter.safetensors"
    save_drafter(drafter, path)
    loaded = load_drafter(build_target("GPT-B", **TINY), path)  # the file says which type it holds
    assert type(loaded) is type(drafter) and getattr(loaded, "feature_layers", None) == getattr(drafter, "feature_layers", None)
    torch.testing.assert_close(started(loaded, COMMITTED), started(drafter, COMMITTED), atol=0, rtol=0)
    assert not torch.equal(started(build_drafter(target, seed=4, kind=drafter_type), COMMITTED), started(drafter, COMMITTED))
    with pytest.raises(SpecimgError, match="safetensors"):
        save_drafter(drafter, tmp_path / "drafter.pt")
    other = build_target("GPT-B", **dict(TINY, dim=32, n_head=2))
    with pytest.raises(SpecimgError, match="shape"):
        load_drafter(other, path)
