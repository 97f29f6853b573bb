"""Drafter data and training: self-distillation, loss hooks, resume after a kill, two processes, CLI."""

from __future__ import annotations

import json
import math
import os

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file

from specimg import MethodSpec, Sampling, hookimpl
from specimg.engine import ar_tokens
from specimg.errors import SpecimgError
from specimg.models import load_drafter
from specimg.models.llamagen import LlamaGenTarget, build_target
from specimg.plugins import PluginManager
from specimg.train.data import DataSpec, DrafterData, make_drafter_data, shard_name
from specimg.train.drafter import TrainConfig, train_drafter
from specimg.train.schedule import WarmupCosine

TINY = dict(dim=64, n_layer=2, n_head=4, vocab_size=64, block_size=16, multiple_of=32, num_classes=10, initializer_range=0.1)
FAST = dict(lr=3e-3, log_every=1, warmup_steps=2)


def tiny(seed: int = 0) -> LlamaGenTarget:
    return build_target("GPT-B", seed=seed, **TINY)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """16 self-distilled images (x2 rows: conditional and null class) in 3 shards."""
    path = str(tmp_path_factory.mktemp("data") / "data")
    make_drafter_data(tiny(), path, DataSpec(num_samples=16, shard_size=6, batch_size=8, seed=5))
    return path


@pytest.fixture(scope="module")
def data3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same images as ``data_dir``, made for an EAGLE-3 drafter (the target's layers too)."""
    path = str(tmp_path_factory.mktemp("data3") / "data")
    make_drafter_data(tiny(), path, DataSpec(num_samples=16, shard_size=6, batch_size=8, seed=5, drafter_type="eagle3"))
    return path


def read_log(path: str) -> list[dict]:
    with open(os.path.join(path, "log.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def warmup_cosine_lr(step: int, lr: float, steps: int, warmup: int, min_lr_ratio: float = 0.0) -> float:
    """The trainers' learning rate at optimizer step ``step`` as they computed it before torch's scheduler did."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@pytest.mark.parametrize("lr, steps, warmup, min_lr_ratio", [(3e-5, 200, 10, 0.0), (1e-3, 100, 5, 0.1), (2e-3, 10, 0, 0.2), (3e-3, 420, 21, 0.0)])
def test_the_schedule_gives_the_closed_form_rates_also_when_resumed(lr, steps, warmup, min_lr_ratio) -> None:
    params = [torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD(params, lr=lr)
    schedule = WarmupCosine(optimizer, lr, steps, warmup, min_lr_ratio)
    rates = []
    for _ in range(steps + 2):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates == [warmup_cosine_lr(k, lr, steps, warmup, min_lr_ratio) for k in range(steps + 2)]
    for start in (1, warmup, steps // 2, steps):
        resumed = torch.optim.SGD(params, lr=123.0)
        WarmupCosine(resumed, lr, steps, warmup, min_lr_ratio, start=start)
        assert resumed.param_groups[0]["lr"] == rates[start]


def weights(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "drafter.safetensors"))


# ----------------------------------------------------------------------------- data


def test_data_holds_teacher_forced_features_and_resumes(data_dir: str, tmp_path) -> None:
    target = tiny()
    data = DrafterData(data_dir)
    assert len(data) == 32 and data.meta["num_shards"] == 3
    batch = data.get(range(len(data)))
    cond, null = batch["labels"] < 10, batch["labels"] == 10
    assert cond.sum() == null.sum() == 16
    with torch.no_grad():
        ref = target.forward_sequence(batch["labels"], batch["tokens"]).hidden
    torch.testing.assert_close(batch["features"], ref, atol=1e-5, rtol=0)
    sampled = ar_tokens(target, [i % 10 for i in range(16)], [5 + i for i in range(16)], Sampling(cfg_scale=4.0))
    assert torch.equal(batch["tokens"][cond], sampled)

    # a kill between shards: the run started again only makes what is missing, identically
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(data_dir):
        if name != shard_name(1):
            (copy / name).write_bytes(open(os.path.join(data_dir, name), "rb").read())
    with pytest.raises(SpecimgError, match="incomplete"):
        DrafterData(copy)
    make_drafter_data(target, copy, DataSpec(num_samples=16, shard_size=6, batch_size=5, seed=5))
    again = load_file(str(copy / shard_name(1)))
    for key, value in load_file(os.path.join(data_dir, shard_name(1))).items():
        torch.testing.assert_close(again[key], value, atol=1e-5, rtol=0)
    with pytest.raises(SpecimgError, match="other settings"):
        make_drafter_data(target, copy, DataSpec(num_samples=16, shard_size=6, seed=6))
    with pytest.raises(SpecimgError, match="another target checkpoint"):
        DrafterData(data_dir).check_target(tiny(seed=1))


def test_data_from_a_tokens_file(tmp_path) -> None:
    target = tiny()
    tokens = torch.randint(0, 64, (5, 16), generator=torch.Generator().manual_seed(0))
    save_file({"tokens": tokens, "labels": torch.tensor([0, 1, 2, 3, 4])}, str(tmp_path / "tok.safetensors"))
    make_drafter_data(target, tmp_path / "d", DataSpec(tokens_file=str(tmp_path / "tok.safetensors"), uncond=False))
    batch = DrafterData(tmp_path / "d").get(range(5))
    assert torch.equal(batch["tokens"], tokens) and batch["labels"].tolist() == [0, 1, 2, 3, 4]
    save_file({"tokens": tokens[:, :8].contiguous()}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(SpecimgError, match=r"\[M, 16\]"):
        make_drafter_data(target, tmp_path / "e", DataSpec(tokens_file=str(tmp_path / "bad.safetensors")))


# ----------------------------------------------------------------------------- training


def test_loss_decreases_and_only_the_drafter_trains(data_dir: str, tmp_path) -> None:
    target = tiny()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    result = train_drafter(target, data_dir, tmp_path / "run", TrainConfig(steps=40, batch_size=8, **FAST), progress=False)
    log = read_log(str(tmp_path / "run"))
    assert [e["step"] for e in log] == list(range(40))
    first, last = log[0]["loss"], sum(e["loss"] for e in log[-5:]) / 5
    assert last < 0.75 * first, (first, last)
    assert log[-1]["acc"] > log[0]["acc"]
    for key, value in target.state_dict().items():
        assert torch.equal(value, before[key]), key
    saved = weights(str(tmp_path / "run"))
    assert set(saved) == set(result.drafter.state_dict()) and not any(k.startswith(("tok_embeddings", "output")) for k in saved)


def test_eagle3_data_holds_the_targets_layers(data_dir: str, data3_dir: str) -> None:
    one, three = DrafterData(data_dir), DrafterData(data3_dir)
    assert (one.drafter_type, three.drafter_type, three.feature_layers) == ("eagle1", "eagle3", (0, 1, 1))
    a, b = one.get([0, 17]), three.get([0, 17])
    assert "layers" not in a and b["layers"].shape == (2, 16, 3 * 64)
    assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["features"], b["features"])  # the same images
    target = tiny()
    target.expose_layers((0, 1, 1))
    out = target.forward_sequence(b["labels"], b["tokens"])  # example 17 is a null-class twin
    torch.testing.assert_close(b["layers"], out.layers, atol=1e-5, rtol=0)


def test_eagle3_training_time_test_learns(data3_dir: str, tmp_path) -> None:
    target = tiny()
    config = TrainConfig(steps=30, batch_size=8, drafter_type="eagle3", ttt_steps=3, **FAST)
    result = train_drafter(target, data3_dir, tmp_path / "run", config, progress=False)
    log = read_log(str(tmp_path / "run"))
    assert set(log[0]) >= {"acc", "acc1", "acc2"} and log[0]["reg"] == 0.0
    assert log[-1]["kl"] < 0.5 * log[0]["kl"], (log[0]["kl"], log[-1]["kl"])
    assert min(e["acc2"] for e in log[-5:]) > log[0]["acc2"]  # the unrolled steps learn too
    loaded = load_drafter(tiny(), result.path)
    assert loaded.kind == "eagle3" and all(torch.equal(v, result.drafter.state_dict()[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(SpecimgError, match="--init.*eagle3 drafter.*not the eagle1"):
        train_drafter(tiny(), data3_dir, tmp_path / "again", TrainConfig(steps=1, batch_size=8), init=result.path, progress=False)


class Scale:
    """A runtime plugin: method ``name`` multiplies both parts of the loss, or shifts the
    regression."""

    def __init__(self, name: str, factor: float = 1.0, shift: float = 0.0):
        self.name, self.factor, self.shift = name, factor, shift

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec(self.name, description="test"))

    @hookimpl
    def train_loss(self, soft_ce, regression, mask):
        assert soft_ce.shape == regression.shape == mask.shape
        return soft_ce * self.factor, regression * self.factor + self.shift


class Whole:
    """The hook as it was before it took the loss's parts: it returns one tensor."""

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("whole", description="test"))

    @hookimpl
    def train_loss(self, soft_ce, regression):
        return soft_ce + regression


def test_train_loss_hooks_fold_in_method_string_order(data_dir: str, tmp_path) -> None:
    pm = PluginManager()
    pm.register(Scale("double", factor=2.0), "double")
    pm.register(Scale("plusone", shift=1.0), "plusone")
    pm.register(Whole(), "whole")
    config = TrainConfig(steps=1, batch_size=8, **FAST)

    def step0(method: str | None) -> dict:
        out = tmp_path / (method or "plain")
        train_drafter(tiny(), data_dir, out, config, method=method, plugins=pm, progress=False)
        return read_log(str(out))[0]

    plain, doubled = step0(None), step0("double")
    assert doubled["loss"] == 2 * plain["loss"]
    assert (doubled["ce"], doubled["reg"]) == (plain["ce"], plain["reg"])
    assert step0("naive")["loss"] == plain["loss"]  # a method without train_loss passes
    shift = config.w_reg  # plusone adds 1 to the regression, which weighs w_reg
    assert step0("double+plusone")["loss"] == pytest.approx(2 * plain["loss"] + shift, rel=1e-6)
    assert step0("plusone+double")["loss"] == pytest.approx(2 * (plain["loss"] + shift), rel=1e-6)
    with pytest.raises(SpecimgError, match=r"'whole': train_loss returned a tensor of shape \(8, \d+\), expected the parts"):
        step0("whole")


def test_cascade_boosts_only_the_cross_entropy(data_dir: str, tmp_path) -> None:
    pm = PluginManager()
    if "cascade" not in pm.methods():
        pytest.skip("cascade is not installed")
    config = TrainConfig(steps=1, batch_size=8, **FAST)
    logs = {}
    for name, opts in (("plain", None), ("b0", {"beta": "0"}), ("b1", {"beta": "1", "tau_seq": "-1"})):
        train_drafter(tiny(), data_dir, tmp_path / name, config, method=None if opts is None else "cascade",
                      options=None if opts is None else {"cascade": opts}, plugins=pm, progress=False)
        logs[name] = read_log(str(tmp_path / name))[0]
    assert logs["b0"]["loss"] == logs["plain"]["loss"]
    # tau_seq -1: every position after the first is convergent, its cross-entropy counts
    # (1 + beta) = 2 times; the regression counts once, so the loss grows by less than w_cls * ce
    extra = logs["b1"]["loss"] - logs["plain"]["loss"]
    assert 0 < extra <= config.w_cls * logs["plain"]["ce"] * (1 + 1e-6)


class Killed(Exception):
    pass


def test_a_killed_run_resumes_to_the_same_weights(data_dir: str, tmp_path) -> None:
    config = TrainConfig(steps=8, batch_size=8, checkpoint_every=3, noise=0.05, **FAST)
    train_drafter(tiny(), data_dir, tmp_path / "whole", config, progress=False)

    def kill_after_5(info):
        if info.step == 5:
            raise Killed

    with pytest.raises(Killed):  # killed 2 steps after the checkpoint of step 3
        train_drafter(tiny(), data_dir, tmp_path / "cut", config, on_step=kill_after_5, progress=False)
    state = json.loads((tmp_path / "cut" / "state.json").read_text())
    assert state["step"] == 3 and not state["done"]
    assert not (tmp_path / "cut" / "drafter.safetensors").exists()
    train_drafter(tiny(), data_dir, tmp_path / "cut", config, progress=False)
    whole, cut = weights(str(tmp_path / "whole")), weights(str(tmp_path / "cut"))
    for key in whole:
        assert torch.equal(whole[key], cut[key]), key
    strip = lambda log: [{k: v for k, v in e.items() if k != "seconds"} for e in log]  # noqa: E731
    assert strip(read_log(str(tmp_path / "cut"))) == strip(read_log(str(tmp_path / "whole")))
    assert [e["lr"] for e in read_log(str(tmp_path / "cut"))] == [warmup_cosine_lr(k, config.lr, config.steps, config.warmup) for k in range(config.steps)]
    assert sorted(os.listdir(tmp_path / "cut" / "checkpoints")) == ["step-000006", "step-000008"]
    again = train_drafter(tiny(), data_dir, tmp_path / "cut", config, on_step=kill_after_5, progress=False)  # finished: no step runs
    assert again.steps == 8 and all(torch.equal(v, whole[k]) for k, v in again.drafter.state_dict().items())
    with pytest.raises(SpecimgError, match="other settings.*--steps"):
        train_drafter(tiny(), data_dir, tmp_path / "cut", TrainConfig(steps=9, batch_size=8, **FAST), progress=False)


def test_user_errors(data_dir: str, tmp_path) -> None:
    with pytest.raises(SpecimgError, match="EAGLE-1 data.*make-drafter-data --drafter-type eagle3"):
        train_drafter(tiny(), data_dir, tmp_path / "a", TrainConfig(steps=1, drafter_type="eagle3"))
    with pytest.raises(SpecimgError, match="another target"):
        train_drafter(tiny(seed=3), data_dir, tmp_path / "b", TrainConfig(steps=1))
    with pytest.raises(SpecimgError, match="fewer than one batch"):
        train_drafter(tiny(), data_dir, tmp_path / "c", TrainConfig(steps=1, batch_size=64))
    with pytest.raises(SpecimgError, match="unknown method"):
        train_drafter(tiny(), data_dir, tmp_path / "d", TrainConfig(steps=1), method="nope")
    with pytest.raises(SpecimgError, match="not a drafter data folder"):
        train_drafter(tiny(), tmp_path, tmp_path / "e", TrainConfig(steps=1))


# ----------------------------------------------------------------------------- two processes


def _two_process_worker(data_dir: str, out: str, results: str, drafter_type: str) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # forked from a process that had a single-process state
    accelerator = Accelerator()
    torch.set_num_threads(1)  # after the state, which sets (host cores / processes) threads
    seen: list[list[int]] = []
    result = train_drafter(
        tiny(), data_dir, out, TrainConfig(steps=4, batch_size=8, checkpoint_every=2, drafter_type=drafter_type, **FAST),
        accelerator=accelerator, on_step=lambda info: seen.append(list(info.indices)), progress=False,
    )
    rank = accelerator.process_index
    torch.save({"world": accelerator.num_processes, "seen": seen, "state": result.drafter.state_dict()}, os.path.join(results, f"rank{rank}.pt"))
    # no destroy_process_group: the FileStore would delete debug_launcher's rendezvous file before it does


@pytest.mark.parametrize("drafter_type", ["eagle1", "eagle3"])
def test_two_cpu_processes_train_their_own_shards_to_one_drafter(data_dir: str, data3_dir: str, tmp_path, drafter_type: str) -> None:
    from accelerate import debug_launcher

    data_dir = data3_dir if drafter_type == "eagle3" else data_dir
    single: list[list[int]] = []
    train_drafter(
        tiny(), data_dir, tmp_path / "one", TrainConfig(steps=4, batch_size=8, checkpoint_every=2, drafter_type=drafter_type, **FAST),
        on_step=lambda info: single.append(list(info.indices)), progress=False,
    )
    debug_launcher(_two_process_worker, args=(data_dir, str(tmp_path / "two"), str(tmp_path), drafter_type), num_processes=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    for step, (a, b) in enumerate(zip(r0["seen"], r1["seen"])):
        assert len(a) == len(b) == 4 and not set(a) & set(b)  # each rank its own half of the global batch
        assert a + b == single[step]
    for key, value in r0["state"].items():
        assert torch.equal(value, r1["state"][key]), key  # DDP keeps the ranks identical
        torch.testing.assert_close(value, weights(str(tmp_path / "one"))[key], atol=1e-5, rtol=1e-4)  # = one process
    log = read_log(str(tmp_path / "two"))
    assert [e["step"] for e in log] == [0, 1, 2, 3]
    torch.testing.assert_close(log[0]["loss"], read_log(str(tmp_path / "one"))[0]["loss"], atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- CLI


def test_cli_eagle3_from_data_to_generate_and_bench(tmp_path, capsys) -> None:
    from cli_runner import run

    save_file(tiny().state_dict(), str(tmp_path / "gpt.safetensors"))
    target = ["--target", str(tmp_path / "gpt.safetensors"), *(x for key, value in TINY.items() for x in ("--target-config", f"{key}={value}"))]
    data, data1, run3 = (str(tmp_path / name) for name in ("data3", "data1", "run3"))
    assert run("make-drafter-data", *target, "--out", data, "-n", "4", "--device", "cpu", "--drafter-type", "eagle3") == 0
    assert run("make-drafter-data", *target, "--out", data1, "-n", "4", "--device", "cpu") == 0
    train = ["train-drafter", *target, "--steps", "2", "--batch-size", "4", "--device", "cpu", "--drafter-type", "eagle3"]
    capsys.readouterr()
    assert run(*train, "--data", data1, "--out", str(tmp_path / "bad")) == 2  # EAGLE-1 data: one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("specimg: error:") and "--drafter-type eagle3" in err and "Traceback" not in err
    assert run(*train, "--data", data, "--out", run3, "--ttt-steps", "2", "--method", "cascade") == 0
    assert json.loads(open(os.path.join(run3, "run.json")).read())["config"]["ttt_steps"] == 2
    drafter = ["--drafter", os.path.join(run3, "drafter.safetensors")]  # its type is in the file
    gen = ["generate", "--model", "tiny-random", *target, *drafter, "-n", "1", "--tree", "chain", "--depth", "3", "--device", "cpu"]
    for method in ("naive", "cascade"):  # no tokenizer here: lantern and gsd decode with the engine's (test_engine)
        assert run(*gen, "--method", method, "--out", str(tmp_path / method)) == 0
    bench = ["bench", "--model", "tiny-random", *target, *drafter, "-n", "1", "--warmup", "0", "--no-quality", "--depth", "2", "--topk", "2", "--total-tokens", "4"]
    assert run(*bench, "--methods", "ar,naive,cascade", "--device", "cpu", "--out", str(tmp_path / "bench")) == 0


def test_cli_makes_data_and_trains(tmp_path) -> None:
    from click.testing import CliRunner

    from specimg.cli import cli

    runner = CliRunner()
    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    result = runner.invoke(cli, ["make-drafter-data", "--target", "tiny-random", "--out", data, "-n", "4", "--cfg-scale", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    args = ["train-drafter", "--target", "tiny-random", "--data", data, "--out", run, "--steps", "3", "--batch-size", "4", "--device", "cpu"]
    result = runner.invoke(cli, args + ["--method", "naive"])
    assert result.exit_code == 0, result.output
    assert os.path.exists(os.path.join(run, "drafter.safetensors")) and len(read_log(run)) == 2  # steps 0 and 2 (the last)
    trained, again = os.path.join(run, "drafter.safetensors"), str(tmp_path / "again")
    result = runner.invoke(cli, [*args[:6], again, *args[7:], "--init", trained, "--lr", "1e-12", "--steps", "1", "--seed", "7"])
    assert result.exit_code == 0, result.output
    with open(os.path.join(again, "run.json")) as file:
        assert json.load(file)["init"] == os.path.abspath(trained)
    before, after = load_file(trained), load_file(os.path.join(again, "drafter.safetensors"))
    assert before.keys() == after.keys() and all(torch.allclose(before[k], after[k], atol=1e-6) for k in before)  # not seed 7's fresh weights
    result = runner.invoke(cli, [*args[:6], str(tmp_path / "none"), *args[7:], "--init", str(tmp_path / "missing.safetensors")])
    assert isinstance(result.exception, SpecimgError) and "missing.safetensors" in str(result.exception)
    result = runner.invoke(cli, args + ["--drafter-type", "eagle3"])
    assert isinstance(result.exception, SpecimgError) and "make-drafter-data --drafter-type eagle3" in str(result.exception)

    # a checkpoint file, shaped by --preset and --target-config
    save_file(tiny().state_dict(), str(tmp_path / "gpt.safetensors"))
    shape = [x for key, value in TINY.items() for x in ("--target-config", f"{key}={value}")]
    target = ["--target", str(tmp_path / "gpt.safetensors"), *shape]
    result = runner.invoke(cli, ["make-drafter-data", *target, "--out", str(tmp_path / "d2"), "-n", "8", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["train-drafter", *target, "--data", str(tmp_path / "d2"), "--out", str(tmp_path / "r2"), "--steps", "2", "--batch-size", "8", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["train-drafter", "--target", "tiny-random", "--data", str(tmp_path / "d2"), "--out", str(tmp_path / "r3"), "--device", "cpu"])
    assert isinstance(result.exception, SpecimgError) and "another shape" in str(result.exception)


def test_processes_share_the_shards(tmp_path) -> None:
    target, spec = tiny(), DataSpec(num_samples=5, shard_size=2)
    make_drafter_data(target, tmp_path / "one", spec)
    for rank in (0, 1):  # what two processes of `accelerate launch` do, one after the other
        make_drafter_data(target, tmp_path / "two", spec, process_index=rank, num_processes=2)
    one, two = DrafterData(tmp_path / "one").get(range(10)), DrafterData(tmp_path / "two").get(range(10))
    assert all(torch.equal(one[k], two[k]) for k in one)


# ----------------------------------------------------------------------------- text-to-image

T2I = dict(TINY, model_type="t2i", cls_token_num=5, caption_dim=12)


def captions(n: int) -> list:
    """Left-padded captions of different lengths, as captions_for_target makes them."""
    from specimg.models.text_encoder import HashTextEncoder, captions_for_target

    texts = ["a red cube", "two dogs on a beach at night", "a bird", "an old green tram"]
    return captions_for_target(HashTextEncoder(dim=12), [texts[i % len(texts)] for i in range(n)], 5, 12)


def test_t2i_data_holds_caption_and_unconditional_features_and_trains(tmp_path) -> None:
    from specimg.models.base import Caption

    target = build_target("GPT-B", seed=0, **T2I)
    caps = captions(4)
    spec = DataSpec(num_samples=4, captions=tuple(caps), prompts=("a", "b", "c", "d"), shard_size=3, seed=2, sampling=Sampling(cfg_scale=3.0))
    meta = make_drafter_data(target, tmp_path / "d", spec)
    assert meta["settings"]["prompts"] == ["a", "b", "c", "d"] and meta["num_examples"] == 8
    batch = DrafterData(tmp_path / "d").get(range(8))
    cond = batch["labels"] >= 0
    assert batch["labels"][cond].tolist() == [0, 1, 2, 3] and (batch["labels"][~cond] == -1).sum() == 4
    assert torch.equal(batch["tokens"][cond], ar_tokens(target, caps, [2, 3, 4, 5], Sampling(cfg_scale=3.0)))
    order = batch["labels"][cond].tolist()
    nulls = [Caption(target.cls_embedding.uncond_embedding, caps[i].mask) for i in order]
    with torch.no_grad():
        ref_cond = target.forward_sequence([caps[i] for i in order], batch["tokens"][cond]).hidden
        ref_null = target.forward_sequence(nulls, batch["tokens"][~cond]).hidden
    torch.testing.assert_close(batch["features"][cond], ref_cond, atol=1e-5, rtol=0)
    torch.testing.assert_close(batch["features"][~cond], ref_null, atol=1e-5, rtol=0)
    with pytest.raises(SpecimgError, match="other settings"):  # other captions never finish this folder
        make_drafter_data(target, tmp_path / "d", attrs.evolve(spec, captions=tuple(captions(5)[1:])))
    with pytest.raises(SpecimgError, match="one caption per sample"):
        make_drafter_data(target, tmp_path / "e", attrs.evolve(spec, captions=tuple(caps[:2])))
    result = train_drafter(target, tmp_path / "d", tmp_path / "run", TrainConfig(steps=4, batch_size=4, **FAST), progress=False)
    assert result.steps == 4 and all(torch.isfinite(torch.tensor(e["loss"])) for e in read_log(str(tmp_path / "run")))


def test_cli_drafter_from_prompts_for_a_t2i_checkpoint(tmp_path, tiny_preset) -> None:
    """make-drafter-data and train-drafter on a t2i checkpoint given by its path alone."""
    import argparse

    from click.testing import CliRunner

    from specimg.cli import cli
    from specimg.models.text_encoder import HashTextEncoder

    args = argparse.Namespace(gpt_model="GPT-T", gpt_type="t2i", vocab_size=64, cls_token_num=5, image_size=64, downsample_size=16, num_classes=10)
    torch.save({"model": build_target("GPT-B", seed=0, **T2I).state_dict(), "args": args}, tmp_path / "t2i.pt")
    HashTextEncoder(dim=12).save(tmp_path / "enc.safetensors")
    (tmp_path / "p.txt").write_text("a red cube\na dog\na tram at night\n")
    runner = CliRunner()
    target = ["--target", str(tmp_path / "t2i.pt")]
    data = ["--prompts", str(tmp_path / "p.txt"), "--text-encoder", str(tmp_path / "enc.safetensors")]
    result = runner.invoke(cli, ["make-drafter-data", *target, *data, "--out", str(tmp_path / "d"), "-n", "4", "--cfg-scale", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert DrafterData(tmp_path / "d").meta["settings"]["prompts"] == ["a red cube", "a dog", "a tram at night", "a red cube"]
    result = runner.invoke(cli, ["train-drafter", *target, "--data", str(tmp_path / "d"), "--out", str(tmp_path / "r"), "--steps", "2", "--batch-size", "4", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert os.path.exists(tmp_path / "r" / "drafter.safetensors")
    result = runner.invoke(cli, ["make-drafter-data", *target, "--out", str(tmp_path / "x"), "-n", "2", "--device", "cpu"])
    assert isinstance(result.exception, SpecimgError) and "needs --prompts FILE or --prompt TEXT" in str(result.exception)
    result = runner.invoke(cli, ["make-drafter-data", "--target", "tiny-random", *data, "--out", str(tmp_path / "y"), "-n", "2", "--device", "cpu"])
    assert isinstance(result.exception, SpecimgError) and "needs a t2i target" in str(result.exception)
