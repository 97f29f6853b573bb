"""The cost model's cache is checked before use: a corrupt file is measured again and
rewritten, never planned on nor a traceback; its key covers what the timings depend on."""

import json
import math
import platform

import numpy as np
import pytest
import torch

import specimg
from specimg import costs
from specimg.costmodel import LEVEL_WIDTHS, VERIFY_SIZES, CostModel
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target

TINY = dict(dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=64, num_classes=5, block_size=16)
SAMPLING = specimg.Sampling(cfg_scale=2.0)


@pytest.fixture(scope="module")
def models():
    target = build_target("GPT-B", seed=0, **TINY)
    return target, build_drafter(target, seed=1)


@pytest.fixture
def measured(tmp_path, monkeypatch, models):
    """A private cache and a stand-in for the measurement (fast, and it counts): returns
    (the model a measurement gives, the cache file of these models, the measurement count)."""
    monkeypatch.setenv("SPECIMG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "_memory", {})
    key, machine = costs.cost_key(*models, SAMPLING)
    verify = tuple((n, 1.0 if n <= 8 else 50.0 + n / 128 * 50.0) for n in VERIFY_SIZES)  # flat to 8 nodes, then dear
    draft = tuple((k, 0.01 + k / 1000) for k in LEVEL_WIDTHS)
    fresh = CostModel(key, machine, verify, draft, draft, 0.01, 0.01, 1.0)
    calls = []

    def measure(*args, **kwargs):
        calls.append(args)
        return fresh

    monkeypatch.setattr(costs, "measure", measure)
    return fresh, tmp_path / "costs" / f"{key}.json", calls


def fields(model: CostModel, **changes) -> str:
    """``model``'s cache file with some fields changed (JSON writes NaN and Infinity as such)."""
    return json.dumps({**json.loads(model.to_json()), **changes})


CORRUPT = {
    "not json": lambda m: "{not json",
    "empty file": lambda m: "",
    "nested lists": lambda m: "[" * 100_000 + "]" * 100_000,
    "nested objects": lambda m: '{"a":' * 100_000 + "1" + "}" * 100_000,
    "a list": lambda m: "[1, 2]",
    "null": lambda m: "null",
    "NaN verify time": lambda m: fields(m, verify_ms=[[1, math.nan], [2, 1.0]]),
    "infinite AR time": lambda m: fields(m, ar_ms=math.inf),
    "negative draft time": lambda m: fields(m, draft_base_ms=[[1, -0.5], [2, 0.02]]),
    "zero overhead": lambda m: fields(m, overhead_ms=0),
    "an AR step of ages": lambda m: fields(m, ar_ms=1e308),
    "a vanishing step scale": lambda m: fields(m, step_scales={"naive": 5e-324}),
    "huge integer": lambda m: fields(m, ar_ms=10**400),
    "time as a string": lambda m: fields(m, draft_start_ms="0.01"),
    "time as a boolean": lambda m: fields(m, ar_ms=True),
    "empty table": lambda m: fields(m, verify_ms=[]),
    "table as a string": lambda m: fields(m, draft_level_ms="12"),
    "table as an object": lambda m: fields(m, draft_level_ms={"1": 0.01}),
    "short row": lambda m: fields(m, verify_ms=[[1]]),
    "fractional size": lambda m: fields(m, verify_ms=[[1.5, 1.0]]),
    "size as a string": lambda m: fields(m, verify_ms=[["1", 1.0]]),
    "zero size": lambda m: fields(m, verify_ms=[[0, 1.0]]),
    "sizes repeated": lambda m: fields(m, verify_ms=[[1, 1.0], [1, 1.0]]),
    "sizes decreasing": lambda m: fields(m, verify_ms=[[2, 1.0], [1, 1.0]]),
    "times decreasing": lambda m: fields(m, verify_ms=[[1, 2.0], [2, 1.0]]),
    "one row": lambda m: fields(m, verify_ms=[[1, 0.5]]),
    "a size not measured": lambda m: fields(m, verify_ms=[[1, 1.0], [3, 1.0]]),
    "a huge size": lambda m: fields(m, verify_ms=[[1, 1.0], [10**30, 1.0]]),
    "a row beyond the sizes": lambda m: fields(m, verify_ms=[*json.loads(m.to_json())["verify_ms"], [10**12, 1e6]]),
    "a width not measured": lambda m: fields(m, draft_level_ms=[[1, 0.01], [3, 0.02]]),
    "NaN step scale": lambda m: fields(m, step_scales={"naive": math.nan}),
    "negative step scale": lambda m: fields(m, step_scales={"naive": -1.0}),
    "step scales as a list": lambda m: fields(m, step_scales=[1.0]),
    "acceptance above 1": lambda m: fields(m, acceptance={"naive": [[1.5] * 10] * 10}),
    "NaN acceptance": lambda m: fields(m, acceptance={"naive": [[math.nan] * 10] * 10}),
    "acceptance as a boolean": lambda m: fields(m, acceptance={"naive": [[True] * 10] * 10}),
    "acceptance short a depth": lambda m: fields(m, acceptance={"naive": [[0.5] * 10] * 9}),
    "acceptance as a list": lambda m: fields(m, acceptance=[[0.5] * 10] * 10),
    "key as a number": lambda m: fields(m, key=12),
    "a field missing": lambda m: json.dumps({k: v for k, v in json.loads(m.to_json()).items() if k != "ar_ms"}),
    "an unknown field": lambda m: fields(m, speed="fast"),
    "another model's key": lambda m: fields(m, key="0123456789abcdef"),
}


@pytest.mark.parametrize("corrupt", CORRUPT.values(), ids=CORRUPT.keys())
def test_a_corrupt_cache_file_is_measured_again_and_rewritten(models, measured, corrupt):
    fresh, path, calls = measured
    path.parent.mkdir(parents=True)
    path.write_text(corrupt(fresh))
    assert costs.load_or_measure(*models, SAMPLING, 0) == fresh
    assert len(calls) == 1
    assert CostModel.from_json(path.read_text()) == fresh  # the file now holds the new measurement


def test_a_cache_file_of_binary_garbage_is_measured_again(models, measured):
    fresh, path, calls = measured
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert costs.load_or_measure(*models, SAMPLING, 0) == fresh and len(calls) == 1


def test_a_sound_cache_file_is_used_and_one_without_step_scales_still_reads(models, measured):
    fresh, path, calls = measured
    path.parent.mkdir(parents=True)
    older = json.loads(fresh.to_json())
    del older["step_scales"], older["acceptance"]  # files from before step scales and acceptance
    path.write_text(json.dumps(older))
    assert costs.load_or_measure(*models, SAMPLING, 0) == fresh and not calls


def test_a_calibration_round_trips_through_the_cache_file(models, measured):
    fresh, path, calls = measured
    rates = np.linspace(0.9, 0.0, 100).reshape(10, 10)
    calibrated = costs.with_calibration(costs.load_or_measure(*models, SAMPLING, 0), "naive", 1.2, rates)
    assert calibrated.calibrated("naive") and not calibrated.calibrated("cascade")
    read_back = CostModel.from_json(path.read_text())
    assert read_back == calibrated and len(calls) == 1
    np.testing.assert_array_equal(np.array(read_back.acceptance["naive"]), rates)


def test_the_key_covers_the_tree_capacities():
    target = build_target("GPT-B", seed=0, **TINY)
    small_target = build_target("GPT-B", seed=0, max_tree_nodes=16, **TINY)
    drafter, small_drafter = build_drafter(target, seed=1), build_drafter(target, seed=1, max_tree_nodes=16)
    keys = {costs.cost_key(t, d, SAMPLING)[0] for t in (target, small_target) for d in (drafter, small_drafter)}
    assert len(keys) == 4
    assert costs.cost_key(target, drafter, SAMPLING) == costs.cost_key(build_target("GPT-B", seed=0, **TINY), drafter, SAMPLING)


def test_the_key_covers_the_cpu_model(models, monkeypatch):
    assert costs._cpu_name()
    monkeypatch.setattr(costs, "_cpu_name", lambda: "Made-up CPU 9000")
    key, machine = costs.cost_key(*models, SAMPLING)
    assert "Made-up CPU 9000" in machine
    monkeypatch.setattr(costs, "_cpu_name", lambda: "Made-up CPU 9001")
    assert costs.cost_key(*models, SAMPLING)[0] != key


def test_the_cpu_model_falls_back_where_there_is_no_cpuinfo(monkeypatch):
    def no_cpuinfo(*args, **kwargs):
        raise FileNotFoundError("/proc/cpuinfo")

    monkeypatch.setattr(costs, "open", no_cpuinfo, raising=False)
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    assert costs._cpu_name.__wrapped__() == "riscv64"


def test_on_cuda_the_key_covers_the_gpu_its_capability_and_the_cuda_runtime(models, monkeypatch):
    """Faked on the CPU: the device, its name, capability and the runtime's version."""
    monkeypatch.setattr(costs, "device_of", lambda target: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Made-up GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    key, machine = costs.cost_key(*models, SAMPLING)
    assert all(part in machine for part in ("Made-up GPU", "9.0", "CUDA 12.4", costs._cpu_name()))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    newer_runtime = costs.cost_key(*models, SAMPLING)[0]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert len({key, newer_runtime, costs.cost_key(*models, SAMPLING)[0]}) == 3


def test_step_scales_are_kept_per_delta_and_options(models):
    def key(**kwargs):
        return costs.scale_key(specimg.Engine(*models, "cascade", sampling=SAMPLING, **kwargs).stack)

    default = key()
    assert default.startswith("cascade ") and default == key()  # stable
    assert key(options={"cascade": {"tau_pos": 0.5, "delta": 0.1}}) == key(options={"cascade": {"delta": 0.1, "tau_pos": 0.5}})
    assert len({default, key(options={"cascade": {"delta": 0.1}}), key(options={"cascade": {"delta": 0.2}}), key(delta=0.05)}) == 4
    assert default != "cascade" and costs.scale_key(None) == "ar"


def test_each_delta_gets_its_own_step_scale_and_old_scales_are_not_used(models, measured):
    fresh, path, calls = measured
    path.parent.mkdir(parents=True)
    path.write_text(fields(fresh, step_scales={"cascade": 7.0}))  # a scale under the old key: the name alone
    engines = [specimg.Engine(*models, "cascade", {"cascade": {"delta": d}}, sampling=SAMPLING) for d in (0.1, 0.5)]
    for engine in engines:
        engine.prepare(0)
    scales = CostModel.from_json(path.read_text()).step_scales
    assert set(scales) == {"cascade", *(costs.scale_key(e.stack) for e in engines)} and not calls
    assert scales["cascade"] == 7.0 and all(scales[costs.scale_key(e.stack)] > 0 for e in engines)
