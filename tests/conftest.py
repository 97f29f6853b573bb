"""Tiny models run fastest on one thread; more threads only contend on a shared machine.
Neighbour tables and other caches go to a per-session temporary folder, never the user's."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECIMG_CACHE_DIR", str(tmp_path_factory.mktemp("specimg-cache")))
        yield


@pytest.fixture
def tiny_preset(monkeypatch):
    """A tiny model size registered like the official ones (``GPT-T``), so that a tiny
    checkpoint's training args can name it as released files name theirs."""
    from specimg.models.llamagen import PRESETS

    monkeypatch.setitem(PRESETS, "GPT-T", dict(n_layer=2, n_head=4, dim=64, multiple_of=32))
