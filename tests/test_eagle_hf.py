"""EAGLE drafters for the Hugging Face targets (Janus, Lumina-mGPT) through the pieces each
target lends (EagleTarget): 1-D RoPE positions, Lumina's newlines counted, tree expansion
equals chains, greedy speculative decoding with the drafter equals AR, and drafter data
from prompts is the target's own teacher-forced states and trains."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from specimg import Engine, Sampling, TreeConfig  # noqa: E402
from specimg.models.base import Drafter, causal_tree_mask  # noqa: E402
from specimg.models import load_drafter  # noqa: E402
from specimg.models.eagle import EagleTarget, build_drafter, save_drafter  # noqa: E402
from specimg.models.families import load_target  # noqa: E402
from specimg.models.llamagen import rope_1d  # noqa: E402
from specimg.testing.tiny_hf import LUMINA_SIDE, save_tiny_janus, save_tiny_lumina  # noqa: E402
from specimg.testing.trees import path_to  # noqa: E402
from specimg.train.data import DataSpec, DrafterData, make_drafter_data  # noqa: E402
from specimg.train.drafter import TrainConfig, train_drafter  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module", params=["janus", "lumina"])
def target(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "janus":
        save_tiny_janus(path)
        return load_target(path)
    save_tiny_lumina(path)
    return load_target(path, image_size=64)


def test_draft_rope_counts_sequence_positions(target) -> None:
    assert isinstance(target, EagleTarget)
    rope, config = target.draft_rope(), target.draft_config()
    assert rope.shape == (target.num_tokens, config.head_dim // 2, 2) and rope.dtype == torch.float32
    k = torch.arange(target.num_tokens)
    positions = k + k // LUMINA_SIDE if type(target).__name__ == "LuminaTarget" else k  # a newline ends every row
    torch.testing.assert_close(rope, rope_1d(positions, config.head_dim, 10000.0), atol=0, rtol=0)
    assert (config.dim, config.n_head, config.kv_heads) == (target.hidden_size, 4, 2)


def test_drafter_tree_expansion_equals_chains(target) -> None:
    drafter = build_drafter(target, seed=1)
    assert isinstance(drafter, Drafter)
    g = torch.Generator().manual_seed(0)
    hidden, first = torch.randn(2, 5, target.hidden_size, generator=g), torch.randint(0, target.vocab_size, (5,), generator=g)
    parents = [-1, 0, 0, 1, 1, 3, 2]
    tokens = torch.randint(0, target.vocab_size, (7,), generator=g)
    drafter.prefill("a red cat", cfg=True)
    root = drafter.start(hidden, first)
    assert root.shape == (2, target.vocab_size)
    tree = torch.cat([drafter.expand(torch.tensor(parents[a:b]), tokens[a:b]) for a, b in ((1, 3), (3, 5), (5, 7))], dim=1)
    for node in range(1, 7):
        drafter.prefill("a red cat", cfg=True)
        drafter.start(hidden, first)
        path = path_to(node, parents)
        for fed, child in enumerate(path[1:]):
            chain = drafter.expand(torch.tensor([fed]), tokens[child : child + 1])
        torch.testing.assert_close(tree[:, node - 1], chain[:, 0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("drafter_type", ["eagle1", "eagle3"])
def test_greedy_naive_with_an_eagle_drafter_equals_ar(target, tmp_path, drafter_type) -> None:
    drafter = build_drafter(target, seed=2, kind=drafter_type)
    save_drafter(drafter, tmp_path / "d.safetensors")
    loaded = load_drafter(target, tmp_path / "d.safetensors")
    assert loaded.kind == drafter_type
    sampling = Sampling(temperature=0.0, cfg_scale=3.0)
    ar = Engine(target, method="ar", sampling=sampling).generate(["a red cat"]).tokens
    naive = Engine(target, loaded, method="naive", sampling=sampling, tree=TreeConfig(depth=3, topk=2, total_tokens=6)).generate(["a red cat"]).tokens
    assert naive.tolist() == ar.tolist()


def test_drafter_data_from_prompts_is_the_targets_own_states_and_trains(target, tmp_path) -> None:
    prompts = ("a red cat", "a cat")
    spec = DataSpec(num_samples=2, prompts=prompts, seed=3, sampling=Sampling(cfg_scale=3.0), batch_size=1)
    meta = make_drafter_data(target, tmp_path / "d", spec)
    assert meta["num_examples"] == 4 and meta["settings"]["prompts"] == list(prompts)
    batch = DrafterData(tmp_path / "d").get(range(4))
    assert batch["labels"].tolist() == [0, 1, -1, -1]
    ar = Engine(target, method="ar", sampling=Sampling(cfg_scale=3.0)).generate([prompts[1]], seed=4).tokens[0]
    assert batch["tokens"][1].tolist() == ar.tolist()
    # the state before token t, decoded one token at a time, both CFG rows
    seq = batch["tokens"][1]
    out = target.prefill(prompts[1], cfg=True)
    states = [out.hidden[:, 0]]
    for tok in seq[:3]:
        out = target.forward_tree(tok[None], torch.tensor([0]), causal_tree_mask(1))
        target.commit(torch.tensor([0]))
        states.append(out.hidden[:, 0])
    states = torch.stack(states, dim=1)
    torch.testing.assert_close(batch["features"][1, :4], states[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(batch["features"][3, :4], states[1], atol=ATOL, rtol=0)
    result = train_drafter(target, tmp_path / "d", tmp_path / "run", TrainConfig(steps=3, batch_size=2, lr=1e-3, log_every=1), progress=False)
    assert result.steps == 3 and (tmp_path / "run" / "drafter.safetensors").exists()
    assert not any(p.requires_grad for p in target.parameters())


def test_eagle3_data_from_prompts_holds_the_targets_layers_and_trains(target, tmp_path) -> None:
    spec = DataSpec(num_samples=1, prompts=("a cat",), seed=3, sampling=Sampling(cfg_scale=3.0), batch_size=1, drafter_type="eagle3")
    make_drafter_data(target, tmp_path / "d", spec)
    data = DrafterData(tmp_path / "d")
    batch = data.get(range(2))
    assert data.feature_layers == (0, 1, 1) and batch["layers"].shape == (2, target.num_tokens, 3 * target.hidden_size)
    first = target.prefill("a cat", cfg=True)  # the layers' inputs at the last prompt position, both rows
    torch.testing.assert_close(batch["layers"][:, 0], first.layers[:, 0], atol=ATOL, rtol=0)
    assert not torch.allclose(first.layers[..., : target.hidden_size], first.layers[..., target.hidden_size : 2 * target.hidden_size])  # two layers
    config = TrainConfig(steps=2, batch_size=2, lr=1e-3, log_every=1, drafter_type="eagle3")
    result = train_drafter(target, tmp_path / "d", tmp_path / "run", config, progress=False)
    assert load_drafter(target, result.path).kind == "eagle3"
