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


FAKE_PLUGINS = '''
import attrs
import torch
from specimg import MethodSpec, hookimpl


@attrs.frozen
class Options:
    delta: float = 0.3


def method(name):
    class Plugin:
        @hookimpl
        def register_methods(self, register):
            register(MethodSpec(name, Options, "a fake method"))
    return Plugin


class Misspelled(method("misspelled")):
    @hookimpl
    def build_relaxed_distt(self, dist):
        return dist


class Overspends(method("overspends")):
    @hookimpl
    def build_relaxed_dist(self, dist):
        out = torch.zeros_like(dist)
        out[:, 0] = 1.0
        return out


class NoDefaults:
    @hookimpl
    def register_methods(self, register):
        @attrs.frozen
        class Required:
            k: int
        register(MethodSpec("nodefaults", Required))


class Stacked(method("a+b")):
    pass


class OldTrainLoss(method("oldloss")):
    @hookimpl
    def train_loss(self, loss, mask):
        return loss


naive_again, fine, misspelled, overspends = method("naive")(), method("fine")(), Misspelled(), Overspends()
old_train_loss = OldTrainLoss()
no_defaults, stacked = NoDefaults(), Stacked()
'''


@pytest.fixture
def fake_plugins(tmp_path_factory, monkeypatch):
    """Install a fake distribution ``fake-plugins 1.0`` whose ``specimg`` entry points are
    ``{name: attribute of its module}``, first on sys.path; the CLI's manager reloads."""
    import sys

    import specimg.plugins

    def install(**entry_points: str) -> None:
        root = tmp_path_factory.mktemp("site")
        (root / "specimg_fake_plugins.py").write_text(FAKE_PLUGINS)
        info = root / "fake_plugins-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugins\nVersion: 1.0\n")
        lines = [f"{name} = {value}" for name, value in entry_points.items()]
        (info / "entry_points.txt").write_text("[specimg]\n" + "\n".join(lines) + "\n")
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.delitem(sys.modules, "specimg_fake_plugins", raising=False)
        monkeypatch.setattr(specimg.plugins, "_default", None)

    yield install
    sys.modules.pop("specimg_fake_plugins", None)
