"""Every mistake a user can make ends with exit status 2 and one line that says what to fix.

One test per class of mistake, parametrised over the cases; each checks the status, that
stderr is exactly one line, and what the line says.
"""

import json
import os
import sys
import tempfile
from types import SimpleNamespace

import pytest
import torch

from specimg.cli import main
from specimg.cli.options import check_tree_fits
from specimg.config import Sampling, TreeConfig
from specimg.errors import SpecimgError
from specimg.testing.markov import MarkovDrafter
from specimg.tree import DraftSession, build_tree

TINY = ["--model", "tiny-random", "-n", "1"]


def run(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as stop:
        return int(stop.code)
    return 0


def one_line_error(capsys, args: list[str]) -> str:
    """Run the command; it must fail with status 2 and one line on stderr, which is returned."""
    status = run(args)
    err = capsys.readouterr().err
    assert status == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cfg-scale", "inf"], "Invalid value for '--cfg-scale': 'inf' is not a finite number"),
        (["--cfg-scale", "nan"], "Invalid value for '--cfg-scale': 'nan' is not a finite number"),
        (["--temperature", "nan"], "Invalid value for '--temperature': 'nan' is not a finite number"),
        (["--temperature", "inf"], "Invalid value for '--temperature': 'inf' is not a finite number"),
        (["--top-p", "nan"], "Invalid value for '--top-p': 'nan' is not a finite number"),
        (["--temperature", "1e-45"], "temperature 1e-45: give 0 (greedy) or at least 1e-06, below which the logits overflow"),
        (["--cfg-scale", "1e308"], "cfg scale 1e+308: give at most 1e+06, beyond which the guided logits overflow"),
        (["--delta", "nan"], "Invalid value for '--delta': 'nan' is not a finite number"),
        (["-m", "lantern++", "-o", "lantern++.lam=inf"], "option lantern++.lam='inf' is not a valid finite float"),
        (["-m", "cascade", "-o", "cascade.delta=nan"], "option cascade.delta='nan' is not a valid finite float"),
    ],
)
def test_non_finite_numbers_and_ones_that_overflow_the_logits(tmp_path, capsys, args, message):
    line = one_line_error(capsys, ["generate", *TINY, "--out", str(tmp_path / "o"), *args])
    assert message in line
    assert not (tmp_path / "o").exists()


def test_non_finite_training_numbers(tmp_path, capsys):
    line = one_line_error(capsys, ["train-drafter", "--target", "tiny-random", "--data", str(tmp_path), "--out", str(tmp_path / "r"), "--lr", "nan"])
    assert "Invalid value for '--lr': 'nan' is not a finite number" in line


@pytest.mark.parametrize("field", ["temperature", "cfg_scale", "top_p"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_sampling_from_python(field, value):
    with pytest.raises(SpecimgError, match=f"^Sampling.{field} must be a finite number, got {value!r}$"):
        Sampling(**{field: value})


@pytest.mark.parametrize(
    "tree",
    [dict(kind="static"), dict(kind="static", rank_paths=()), dict(rank_paths=((0,),)), dict(kind="dynamic", rank_paths=((0,), (1,)))],
)
def test_rank_paths_and_a_static_tree_go_together_from_python(tree):
    """A static tree without rank paths used to decode as AR; rank paths on another kind were ignored."""
    with pytest.raises(SpecimgError, match=r"^a static tree needs rank_paths, and rank_paths need kind='static'$"):
        TreeConfig(**tree)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", "18446744073709551616"], "Invalid value for '--seed': 18446744073709551616 is not in the range 0<=x<=4294967295"),
        (["--seed", "-1"], "Invalid value for '--seed': -1 is not in the range 0<=x<=4294967295"),
        (["--class-labels", "99999999999999999999"], "class label 99999999999999999999 is outside [0, 10)"),
        (["-n", "99999999999999999999"], "Invalid value for '--num-images' / '-n': 99999999999999999999 is not in the range 1<=x<=1000000"),
        (["--cfg-interval", "99999999999999999999"], "Invalid value for '--cfg-interval': 99999999999999999999 is not in the range -1<=x<=2147483647"),
        (["--threads", "99999999999999999999"], "Invalid value for '--threads': 99999999999999999999 is not in the range 1<=x<=1024"),
        (["--depth", "20"], "this tree takes up to 190 nodes per step in the drafter's cache, which holds 128: lower --topk or --depth"),
        (["--topk", "64", "--total-tokens", "128"], "up to 256 nodes per step in the drafter's cache, which holds 128"),
        (["--total-tokens", "200"], "up to 200 nodes per step in the target's cache, which holds 128: lower --total-tokens, --topk or --depth"),
        (["--tree", "chain", "--depth", "200"], "up to 201 nodes per step in the target's cache, which holds 128: lower --depth"),
        (["--tree", "static", "--rank-paths", " ".join(f"0.{r}" for r in range(128))], "up to 129 nodes per step in the target's cache"),
    ],
)
def test_out_of_range_integers(tmp_path, capsys, args, message):
    assert message in one_line_error(capsys, ["generate", *TINY, "--out", str(tmp_path / "o"), *args])


@pytest.mark.parametrize(
    "tree",
    [
        TreeConfig(depth=4, topk=3, total_tokens=200),
        TreeConfig(depth=4, topk=3, total_tokens=20),
        TreeConfig(depth=3, topk=4, total_tokens=200, sample=True),
        TreeConfig(kind="chain", depth=5),
        TreeConfig(kind="static", rank_paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
    ],
)
def test_the_tree_limits_are_the_sizes_the_builders_reach(tree):
    """check_tree_fits must refuse exactly the trees that overflow: one node less of
    cache than the builders use is refused, the nodes they use are enough."""
    drafter = MarkovDrafter(torch.randn(100, 100, generator=torch.Generator().manual_seed(0)))
    drafter.prefill(0, cfg=False)
    session = DraftSession(drafter, Sampling(), drafter.start(torch.zeros(1, 1, 4), torch.tensor([3])), root_index=0, filtered=tree.sample)
    size = build_tree(session, 3, tree, max_depth=50, generator=torch.Generator().manual_seed(0)).size
    fed = len(drafter._fed) - 1
    cache = lambda n: SimpleNamespace(max_tree_nodes=n)
    check_tree_fits(tree, cache(size), cache(fed))
    with pytest.raises(SpecimgError, match=f"up to {size} nodes per step in the target's cache, which holds {size - 1}"):
        check_tree_fits(tree, cache(size - 1), cache(fed))
    with pytest.raises(SpecimgError, match=f"up to {fed} nodes per step in the drafter's cache, which holds {fed - 1}"):
        check_tree_fits(tree, cache(size), cache(fed - 1))


def test_out_of_range_seed_of_the_training_commands(tmp_path, capsys):
    args = ["make-drafter-data", "--target", "tiny-random", "--out", str(tmp_path), "--seed", str(2**64)]
    assert "Invalid value for '--seed'" in one_line_error(capsys, args)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tree", "static"], "--tree static needs --rank-paths, and --rank-paths needs --tree static"),
        (["--rank-paths", "0 1"], "--tree static needs --rank-paths, and --rank-paths needs --tree static"),
        (["--tree", "static", "--rank-paths", "0 x"], "'0 x' is not a list of rank paths such as '0 1 0.0 0.1'"),
        (["--tree", "static", "--rank-paths", "0 -1"], "names no node, or a negative rank"),
        (["--tree", "static", "--rank-paths", "0 1 0.1 1"], "'0 1 0.1 1' names node 1 twice"),
        (["--tree", "static", "--rank-paths", "0 0.1"], "static tree path (0, 1) lacks its parent or its previous sibling"),
        (["-m", "lantern++", "-o", "lantern++.tree=nosuch"], "bad option for method 'lantern++': 'tree' must be in ('auto', 'default', 'small', 'chain', 'mc_sim_7b_63') (got 'nosuch')"),
        (["-m", "lantern", "-o", "lantern.budget=path"], "bad option for method 'lantern': 'budget' must be in ('node', 'candidate') (got 'path')"),
        (["-m", "lantern", "-o", "lantern.codebook=rawest"], "bad option for method 'lantern': 'codebook' must be in ('normalised', 'raw') (got 'rawest')"),
        (["--method", "naive+"], "unknown method"),
        (["--top"], "'--top-k', '--top-p', '--topk'?) (see 'specimg generate --help')"),
        (["--class-labels", "3,,4"], "--class-labels '3,,4' has an empty item"),
        (["-m", "ar", "--delta", "0.5"], "method 'ar' has no total-variation budget to set"),
    ],
)
def test_bad_choices_and_shapes(tmp_path, capsys, args, message):
    line = one_line_error(capsys, ["generate", *TINY, "--out", str(tmp_path / "o"), *args])
    assert message in line and "Attribute(" not in line


def test_a_static_tree_from_the_command_line_drafts_more_than_one_token(tmp_path, capsys):
    """--tree static used to decode as AR: tau 1.00 whatever the drafts."""
    args = ["generate", "--model", "tiny-random", "-n", "1", "--out", str(tmp_path), "--temperature", "0", "--tree", "static", "--rank-paths", "0 0.0 0.0.0"]
    assert run(args) == 0
    stats = json.loads((tmp_path / "manifest.jsonl").read_text())["stats"]
    assert stats["tree_sizes"] and set(stats["tree_sizes"]) <= {1, 2, 3, 4} and max(stats["tree_sizes"]) == 4


def test_output_folders(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("")
    line = one_line_error(capsys, ["generate", *TINY, "--out", str(afile)])
    assert line == f"specimg: error: Invalid value for '--out': Directory '{afile}' is a file. (see 'specimg generate --help')"
    line = one_line_error(capsys, ["generate", *TINY, "--out", str(afile / "below")])
    assert line == f"specimg: error: --out {afile / 'below'}: {afile} is a file, not a folder; choose another --out"
    assert one_line_error(capsys, ["generate", *TINY, "--out", ""]) == "specimg: error: --out is empty: name a folder"
    for command in (["make-drafter-data", "--target", "tiny-random"], ["train-drafter", "--target", "tiny-random", "--data", str(tmp_path)]):
        assert f"{afile} is a file, not a folder" in one_line_error(capsys, [*command, "--out", str(afile / "x")])

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)  # as root a read-only folder is writable
    line = one_line_error(capsys, ["generate", *TINY, "--out", str(tmp_path / "ro")])
    assert line == f"specimg: error: --out {tmp_path / 'ro'} cannot be written to (Permission denied); choose another --out"
    assert "cannot be written to" in one_line_error(capsys, ["bench", *TINY, "--methods", "ar", "--out", str(tmp_path / "ro")])


def test_train_demo_output_folder(tmp_path, capsys):
    """train-demo checks --out once it has the demo extra (without it, it asks for that first)."""
    pytest.importorskip("sklearn")
    pytest.importorskip("skimage")
    afile = tmp_path / "afile"
    afile.write_text("")
    assert f"{afile} is a file, not a folder" in one_line_error(capsys, ["train-demo", "--scale", "toy", "--out", str(afile / "x")])


def test_train_demo_without_the_demo_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import fails as if not installed
    line = one_line_error(capsys, ["train-demo", "--scale", "toy", "--out", str(tmp_path / "bundle")])
    assert line == "specimg: error: train-demo needs the demo extra (sklearn is missing): pip install 'specimg[demo]'"


class Marker:
    """Unpickling this creates a folder: the proof that loading ran code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("kind, other", [("eagle1", {"dim": 32}), ("eagle3", {"vocab_size": 128})], ids=["eagle1-width", "eagle3-vocabulary"])
def test_a_built_in_model_refuses_another_targets_drafter(tmp_path, capsys, kind, other):
    from specimg.models.eagle import build_drafter, save_drafter
    from specimg.models.llamagen import build_target
    from specimg.models.loading import TINY_GPT

    path = tmp_path / "drafter.safetensors"
    save_drafter(build_drafter(build_target("GPT-B", **{**TINY_GPT, **other}), kind=kind), path)
    line = one_line_error(capsys, ["generate", *TINY, "--drafter", str(path), "--out", str(tmp_path / "o")])
    assert line.startswith(f"specimg: error: {path}: key ") and "the model expects" in line
    assert not (tmp_path / "o").exists()


def test_a_built_in_model_brings_its_own_tokenizer(tmp_path, capsys):
    line = one_line_error(capsys, ["generate", *TINY, "--tokenizer", str(tmp_path / "vq.pt"), "--out", str(tmp_path / "o")])
    assert line == "specimg: error: --tokenizer goes with --target: --model tiny-random brings its own tokenizer"


@pytest.mark.parametrize("kind", ["random", "pickle", "torch-pickle", "empty", "cut"])
@pytest.mark.parametrize("role", ["--target", "--drafter", "--tokenizer"])
def test_unloadable_checkpoints(tmp_path, capsys, kind, role):
    path, marker = tmp_path / f"{kind}.pt", tmp_path / "ran"
    if kind == "random":
        path.write_bytes(torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy().tobytes())
    elif kind == "pickle":
        import pickle

        path.write_bytes(pickle.dumps(Marker(str(marker)), protocol=4))
    elif kind == "torch-pickle":
        torch.save({"weights": Marker(str(marker))}, path)
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        torch.save({"weight": torch.zeros(1000)}, path)
        path.write_bytes(path.read_bytes()[:500])
    good = tmp_path / "target.pt"
    if role != "--target":
        from specimg.models.llamagen import build_target
        from specimg.models.loading import TINY_GPT

        torch.save(build_target("GPT-B", **TINY_GPT).state_dict(), good)
    config = ["--target-config=" + f"{k}={v}" for k, v in {"dim": 64, "n_layer": 2, "n_head": 4, "multiple_of": 32, "vocab_size": 256, "num_classes": 10, "block_size": 64}.items()]
    args = ["generate", "--target", str(path if role == "--target" else good), *config, "-n", "1", "--out", str(tmp_path / "o")]
    if role != "--target":
        args += [role, str(path)]
    line = one_line_error(capsys, args)
    assert not marker.exists()
    assert "weights_only" not in line and "file an issue" not in line
    reason = line.split(f"{path}", 1)[1]
    expected = {
        "random": " safely: it is not a PyTorch checkpoint of weights, or it is damaged",
        "pickle": " safely: it is not a PyTorch checkpoint of weights, or it is damaged",
        "torch-pickle": f" safely: it holds a pickled {os.mkdir.__module__}.mkdir, which no checkpoint of weights needs; it was not loaded",
        "empty": " is empty",
        "cut": " safely: PytorchStreamReader failed reading zip archive",
    }[kind]
    assert reason.startswith(expected), line


def test_stale_output_folders(tmp_path, capsys):
    out = tmp_path / "o"
    assert run(["generate", "--model", "tiny-random", "-n", "2", "--class-labels", "3,7", "--out", str(out)]) == 0
    before = (out / "manifest.jsonl").read_text()
    capsys.readouterr()
    line = one_line_error(capsys, ["generate", "--model", "tiny-random", "-n", "2", "--class-labels", "3,5", "--out", str(out)])
    assert line == f"specimg: error: {out} holds image 1 of class 7, this run asks for class 5: its --class-labels differ; give another --out or remove {out}"
    line = one_line_error(capsys, ["generate", "--model", "tiny-random", "-n", "2", "--class-labels", "3,7", "-m", "ar", "--out", str(out)])
    assert line == f'specimg: error: {out} holds a run with other settings (method: "naive" there, "ar" here); give another --out or remove {out}'
    line = one_line_error(capsys, ["generate", "--model", "tiny-random", "-n", "2", "--class-labels", "3,7", "--temperature", "0.5", "--out", str(out)])
    assert "(sampling.temperature: 1.0 there, 0.5 here)" in line
    assert (out / "manifest.jsonl").read_text() == before
    assert run(["generate", "--model", "tiny-random", "-n", "2", "--class-labels", "3,7", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"naive: {out} already holds these 2 images; nothing to do (more images: raise -n)\n"
    assert (out / "manifest.jsonl").read_text() == before


def test_an_interrupted_run_says_how_to_resume(tmp_path, capsys, monkeypatch):
    import specimg.cli.generate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(specimg.cli.generate, "write_run", interrupted)
    assert run(["generate", *TINY, "--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip() == "specimg: interrupted; the same command resumes where it stopped"  # after click's newline


def test_a_plugin_that_breaks_its_budget_is_named_with_its_package(tmp_path, capsys, fake_plugins):
    fake_plugins(overspends="specimg_fake_plugins:overspends")
    line = one_line_error(capsys, ["generate", *TINY, "-m", "overspends", "--out", str(tmp_path / "o")])
    assert line == (
        "specimg: error: method 'overspends' spent more than its budget, a bug in plugin 'overspends' (fake-plugins 1.0): "
        "leave overspends out of --method and report it to its authors"
    )


def test_faulty_plugins_break_no_command_and_are_listed(tmp_path, capsys, fake_plugins):
    fake_plugins(naive_again="specimg_fake_plugins:naive_again", misspelled="specimg_fake_plugins:misspelled")
    assert run(["generate", *TINY, "--out", str(tmp_path / "o")]) == 0
    *warnings, bar = capsys.readouterr().err.splitlines()
    assert bar.startswith("naive: 100% 64/64 [")  # the progress line stderr gets without a terminal
    assert warnings == [
        "specimg: warning: specimg plugin 'naive_again' (fake-plugins 1.0) is left out: it registers method 'naive', which plugin 'naive' (specimg 0.1.0) already provides",
        "specimg: warning: specimg plugin 'misspelled' (fake-plugins 1.0) is left out: it implements 'build_relaxed_distt', which is not a specimg hook (misspelled?)",
    ]
    line = one_line_error(capsys, ["generate", *TINY, "-m", "misspelled", "--out", str(tmp_path / "p")])
    assert line.startswith("specimg: error: unknown method 'misspelled'")
    assert run(["plugins"]) == 0
    listed = {line.split()[0]: line.split(None, 4)[4] for line in capsys.readouterr().out.splitlines()[1:]}
    assert listed["naive_again"].endswith("FAILED: it registers method 'naive', which plugin 'naive' (specimg 0.1.0) already provides")
    assert listed["misspelled"].endswith("FAILED: it implements 'build_relaxed_distt', which is not a specimg hook (misspelled?)")


def test_a_train_loss_of_the_old_signature_is_left_out_on_one_line_naming_the_argument(capsys, fake_plugins):
    """train_loss once took the combined ``loss``; it now takes the loss's parts (docs/hooks.md)."""
    fake_plugins(oldloss="specimg_fake_plugins:old_train_loss")
    assert run(["plugins"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "FAILED: PluginValidationError: Plugin 'oldloss' for hook 'train_loss' hookimpl definition: train_loss(loss, mask) " in listed["oldloss"]
    assert "Argument(s) {'loss'} are declared in the hookimpl but can not be found in the hookspec" in listed["oldloss"]



def test_tune_refuses_a_method_that_drafts_without_a_drafter(tmp_path, capsys):
    line = one_line_error(capsys, ["tune", "--model", "tiny-random", "-m", "sjd", "-n", "1", "--out", str(tmp_path / "t")])
    assert "sjd drafts without one and sizes its own" in line
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("flag", [["--preset", "GPT-B"], ["--target-config", "block_size=16"], ["--tokenizer-config", "codebook_size=8"]])
def test_a_built_in_model_refuses_checkpoint_options(tmp_path, capsys, flag):
    line = one_line_error(capsys, ["generate", "--model", "tiny-random", *flag, "-n", "1", "--out", str(tmp_path / "o")])
    assert f"{flag[0]} shapes a --target checkpoint; --model tiny-random is built in and takes none" in line


@pytest.mark.parametrize(
    "fault, reason",
    [
        pytest.param("file in the way", "(Not a directory)", id="file in the way"),
        pytest.param("read-only", "(open file failed with strerror: Read-only file system: a read-only or full disk?)", id="read-only"),
        pytest.param("full", "(unexpected pos 704 vs 598: a read-only or full disk?)", id="full"),
    ],
)
def test_a_cache_that_cannot_be_written_costs_lantern_one_warning(tmp_path, capsys, monkeypatch, fault, reason):
    """A neighbour table that cannot be kept is not needed to decode: lantern decodes the
    images it decodes with a writable cache, and says once that the table was not kept."""
    from specimg import neighbours

    args = ["generate", *TINY, "-m", "lantern", "--tree", "chain", "--depth", "2"]
    monkeypatch.setattr(neighbours, "_memory", {})
    monkeypatch.setattr(neighbours, "_by_codebook", {})
    monkeypatch.setenv("SPECIMG_CACHE_DIR", str(tmp_path / "writable"))
    assert run([*args, "--out", str(tmp_path / "kept")]) == 0
    assert list((tmp_path / "writable").glob("neighbours-*.pt"))
    capsys.readouterr()
    monkeypatch.setattr(neighbours, "_memory", {})
    monkeypatch.setattr(neighbours, "_by_codebook", {})
    cache = tmp_path / "cache"
    if fault == "file in the way":
        (tmp_path / "afile").write_text("")
        cache = tmp_path / "afile" / "cache"
    else:  # torch's writer reports these as RuntimeErrors, with these words
        message = {"read-only": "[enforce fail at inline_container.cc:747] . open file failed with strerror: Read-only file system",
                   "full": "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"}[fault]

        def refused(*_, **__):
            raise RuntimeError(message)

        monkeypatch.setattr(torch, "save", refused)
    monkeypatch.setenv("SPECIMG_CACHE_DIR", str(cache))
    assert run([*args, "--out", str(tmp_path / "o")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("specimg:")]
    assert warnings == [
        f"specimg: warning: the neighbour table cannot be kept in {cache} {reason}; decoding goes on without keeping it "
        "(set SPECIMG_CACHE_DIR to a writable folder to keep it)"
    ]
    assert not list(cache.glob("*.pt"))  # neither the table nor a temporary file of it
    tokens = lambda out: [json.loads(line)["tokens"] for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert tokens(tmp_path / "o") == tokens(tmp_path / "kept")


def test_make_drafter_data_on_a_full_disk_says_so_and_resumes(tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as a SafetensorError: one line naming the shard and
    the cause; the shards written are kept, and the same command finishes the folder as
    an uninterrupted run would have made it."""
    import safetensors.torch
    from safetensors import SafetensorError

    args = ["make-drafter-data", "--target", "tiny-random", "-n", "3", "--shard-size", "2", "--device", "cpu"]
    assert run([*args, "--out", str(tmp_path / "whole")]) == 0
    capsys.readouterr()
    real, calls = safetensors.torch.save_file, []

    def full_at_the_second_shard(*a, **k):
        calls.append(a[1])
        if len(calls) == 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(*a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", full_at_the_second_shard)
    out = tmp_path / "d"
    assert run([*args, "--out", str(out)]) == 2
    progress, line = capsys.readouterr().err.splitlines()  # the samples' bar, then the one error
    assert line == (
        f"specimg: error: {out / 'shard-00001.safetensors'} cannot be written (Error while serializing: I/O error: No space left on device "
        "(os error 28)); free space or fix the folder and run the same command again: it resumes"
    )
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors" or p.name.startswith(".tmp")) == ["shard-00000.safetensors"]
    first = (out / "shard-00000.safetensors").read_bytes()
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert run([*args, "--out", str(out)]) == 0
    assert (out / "shard-00000.safetensors").read_bytes() == first
    for name in ("shard-00000.safetensors", "shard-00001.safetensors", "meta.json"):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


@pytest.mark.parametrize(
    "command, message",
    [
        (["bench", *TINY, "--methods", "nosuch"], "unknown method 'nosuch' in 'nosuch'"),
        (["bench", *TINY, "--methods", ""], "--methods '' names nothing: give one value or more, separated by commas"),
        (["bench", *TINY, "--methods", " "], "--methods ' ' names nothing"),
        (["bench", *TINY, "--methods", "naive,,ar"], "--methods 'naive,,ar' has an empty item"),
        (["generate", *TINY, "-m", "nosuch"], "unknown method 'nosuch'"),
        (["tune", *TINY, "--class-labels", "99"], "class label 99 is outside [0, 10)"),
        (["make-drafter-data", "--target", "nosuch"], "checkpoint not found: nosuch"),
        (["make-drafter-data", "--target", "tiny-random"], "self-distilled data needs --num-samples"),  # refused once the run holds its folder
        (["train-drafter", "--target", "tiny-random", "--data", "nosuch"], "nosuch is not a drafter data folder"),
    ],
    ids=lambda value: " ".join(value[:1] + value[-2:]) if isinstance(value, list) else "",
)
def test_a_refused_run_creates_nothing(tmp_path, capsys, command, message):
    line = one_line_error(capsys, [*command, "--out", str(tmp_path / "new" / "out")])
    assert message in line
    assert os.listdir(tmp_path) == []


def test_a_refused_run_keeps_the_folders_it_did_not_make_or_that_are_in_use(tmp_path, capsys):
    from specimg.files import writable_folder
    from specimg.runs import folder

    there = tmp_path / "there"
    there.mkdir()
    one_line_error(capsys, ["bench", *TINY, "--methods", "nosuch", "--out", str(there)])
    assert os.listdir(tmp_path) == ["there"] and os.listdir(there) == []
    for name, holds in [("in use", "a lock"), ("written", "a file")]:
        made = tmp_path / name
        with pytest.raises(SpecimgError), folder.unmade_on_failure():
            writable_folder(made)
            if holds == "a lock":
                held = folder._lock(str(made))  # another run's, held on when this one is refused
            else:
                (made / "kept.txt").write_text("")
            raise SpecimgError("refused")
        assert made.is_dir()
    os.close(held)
