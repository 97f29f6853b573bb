"""Method strings, options, and plugin loading."""

import importlib.metadata

import attrs
import pytest
import torch

from specimg import MethodSpec, hookimpl
from specimg.errors import SpecimgError
from specimg.methods import parse_options
from specimg.plugins import PluginManager
from specimg.stackhooks import StackHooks


@attrs.frozen
class ToyOptions:
    delta: float = 0.2
    k: int = 3
    whole: bool = True


class ToyPlugin:
    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("toy", ToyOptions, "a toy"))


@pytest.fixture
def manager():
    pm = PluginManager()
    pm.register(ToyPlugin(), "toy-plugin")
    return pm


def test_builtins_come_through_entry_points(manager):
    assert "naive" in manager.methods()
    assert any(p.name == "naive" and p.source.startswith("specimg ") for p in manager.plugins)


def test_stack_order_follows_the_method_string(manager):
    stack = manager.stack("toy+naive")
    assert [m.spec.name for m in stack.members] == ["toy", "naive"]
    assert stack.name == "toy+naive"
    assert stack.delta == 0.2
    assert manager.stack("naive+toy", delta=0.05).delta == 0.05


def test_options_are_converted_and_validated(manager):
    stack = manager.stack("toy", parse_options(["toy.k=7", "toy.whole=false", "toy.delta=0.4"]))
    assert stack.members[0].options == ToyOptions(delta=0.4, k=7, whole=False)
    with pytest.raises(SpecimgError, match="no option 'kk'.*delta, k, whole"):
        manager.stack("toy", {"toy": {"kk": "1"}})
    with pytest.raises(SpecimgError, match="not a valid int"):
        manager.stack("toy", {"toy": {"k": "seven"}})
    with pytest.raises(SpecimgError, match=r"delta must lie in \[0, 1\]"):
        manager.stack("toy", {"toy": {"delta": "3"}})
    with pytest.raises(SpecimgError, match="not in the method stack"):
        manager.stack("naive", {"toy": {"k": "1"}})
    with pytest.raises(SpecimgError, match="method.key=value"):
        parse_options(["k=1"])


def test_unknown_method_lists_installed_ones(manager):
    with pytest.raises(SpecimgError, match=r"unknown method 'nope' \(installed: .*naive.*toy"):
        manager.stack("toy+nope")
    with pytest.raises(SpecimgError, match="twice"):
        manager.stack("toy+toy")


def test_a_method_registered_twice_is_refused_naming_the_newcomer(manager):
    with pytest.raises(SpecimgError, match="plugin 'again' is left out: it registers method 'toy', which plugin 'toy-plugin'"):
        manager.register(ToyPlugin(), "again")
    assert manager.stack("toy").members[0].spec.plugin is not None
    assert manager.info("toy-plugin").methods == ("toy",)


def _with_extra_entry_point(monkeypatch, value):
    real = importlib.metadata.entry_points

    def entry_points(group):
        found = list(real(group=group))
        return found + [importlib.metadata.EntryPoint(name="extra", value=value, group=group)]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_a_plugin_that_fails_to_import_is_reported_once_not_fatal(monkeypatch):
    _with_extra_entry_point(monkeypatch, "specimg_no_such_module_anywhere")
    with pytest.warns(UserWarning) as caught:
        pm = PluginManager()
    assert [str(w.message) for w in caught] == [
        "specimg plugin 'extra' (?) is left out: ModuleNotFoundError: No module named 'specimg_no_such_module_anywhere'"
    ]
    assert [p.name for p in pm.failed] == ["extra"]
    assert "naive" in pm.methods()


def test_autoload_can_be_turned_off_for_third_party_plugins(monkeypatch):
    _with_extra_entry_point(monkeypatch, "specimg_no_such_module_anywhere")
    monkeypatch.setenv("SPECIMG_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = PluginManager()
    assert not pm.failed and "naive" in pm.methods()


@pytest.mark.parametrize(
    "entry, error",
    [
        ("naive_again", "it registers method 'naive', which plugin 'naive' (specimg 0.1.0) already provides"),
        ("misspelled", "it implements 'build_relaxed_distt', which is not a specimg hook (misspelled?)"),
        ("no_defaults", "method 'nodefaults': its options class cannot be built from its defaults"),
        ("stacked", "it registers the method name 'a+b', which a method string cannot name"),
    ],
)
def test_a_faulty_plugin_is_left_out_with_its_error(fake_plugins, entry, error):
    """The fake distribution comes first on sys.path: the built-ins must still win."""
    fake_plugins(**{entry: f"specimg_fake_plugins:{entry}", "fine": "specimg_fake_plugins:fine"})
    with pytest.warns(UserWarning, match="left out") as caught:
        pm = PluginManager()
    assert len(caught) == 1
    assert [(p.name, p.source) for p in pm.failed] == [(entry, "fake-plugins 1.0")]
    assert pm.failed[0].error.startswith(error)
    assert pm.info("fine").methods == ("fine",) and pm.provider("naive").source.startswith("specimg ")
    assert pm.stack("naive+fine").name == "naive+fine"
    assert pm.pm.get_plugin(entry) is None


def test_a_misspelled_hook_registered_by_hand_is_an_error(fake_plugins):
    fake_plugins()
    import specimg_fake_plugins

    pm = PluginManager(autoload=False)
    with pytest.raises(SpecimgError, match="'build_relaxed_distt', which is not a specimg hook"):
        pm.register(specimg_fake_plugins.misspelled, "misspelled")
    assert "misspelled" not in pm.methods()


class Halving:
    """A runtime plugin: its train_loss scales by its delta (its options reach it), its
    relaxation always passes."""

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("halving", ToyOptions))

    @hookimpl
    def train_loss(self, soft_ce, regression, options):
        return soft_ce * options.delta, regression

    @hookimpl
    def build_relaxed_dist(self, dist):
        return None


def test_a_stack_binds_each_hook_to_its_members_in_method_string_order(manager):
    manager.register(Halving(), "halving")
    stack = manager.stack("halving+cascade+lantern++", {"halving": {"delta": "0.5"}, "lantern++": {"k": "4"}})
    hooks = StackHooks.bind(manager, stack)
    assert (hooks.propose.owner, hooks.propose.options) == ("lantern++", stack.members[2].options)
    assert hooks.propose.takes_options and not hooks.score.takes_options
    assert (hooks.score.owner, hooks.accept.owner, hooks.accept.options) == (None, None, None)
    assert [(h.method, h.delta, h.options) for h in hooks.relaxers] == [(m.spec.name, m.delta, m.options) for m in stack.members]
    assert [h.method for h in hooks.train_losses] == ["halving", "cascade"]
    ce, reg = hooks.train_losses[0](soft_ce=torch.ones(3), regression=torch.ones(3), w_cls=0.1, w_reg=1.0, features=None, tokens=None, mask=None)
    assert (ce.tolist(), reg.tolist()) == ([0.5, 0.5, 0.5], [1.0, 1.0, 1.0])
    step = dict(target_dist=None, budget=None, tree=None, scores=None, target=None, tokenizer=None)
    assert hooks.relaxers[0](dist=torch.ones(1, 2), **step) is None
    bare = StackHooks.bind(manager, manager.stack("toy"))
    assert (bare.propose.owner, bare.relaxers, bare.train_losses) == (None, (), ())


def test_methods_says_which_relax_image_by_image_in_a_batch(fake_plugins, capsys):
    """overspends relaxes without declaring batch=True; every built-in and the example
    package declare it."""
    from cli_runner import run

    fake_plugins(overspends="specimg_fake_plugins:overspends")
    assert run("methods") == 0
    blocks = capsys.readouterr().out.replace("\n    ", "    ").splitlines()  # one line per method
    says = "in a batch: relaxes image by image (its MethodSpec does not declare batch=True)"
    assert [block.split()[0] for block in blocks if says in block] == ["overspends"]
