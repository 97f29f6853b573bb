"""specimg bench and the quality metrics, on tiny random models."""

from __future__ import annotations

import csv
import io
import json
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from specimg.config import Sampling, TreeConfig
from specimg.engine import Engine, ar_tokens
from specimg.errors import SpecimgError
from specimg.cli import prompts
from specimg.eval import metrics
from specimg.models import text_encoder
from specimg.eval.bench import BenchSpec, csv_text, markdown_table, plan_variants, run_bench, stack_members, summarise, write_outputs
from specimg.eval.metrics import frechet_distance
from specimg.eval.quality import AR_FLOOR_SEED, Quality
from specimg.models import loading
from specimg.models.base import Caption
from specimg.sampling import probabilities
from specimg.stats import ImageStats

INSTALLED = ("naive", "lantern", "lantern++", "gsd", "cascade")
SAMPLING = Sampling(cfg_scale=2.0)


@pytest.fixture(scope="module")
def models():
    return loading.tiny_random()


class OneProcess:
    process_index, num_processes, is_main_process = 0, 1, True

    def wait_for_everyone(self) -> None:
        pass


def spec_for(variants, labels, seed=0, warmup=0):
    return BenchSpec(tuple(variants), tuple(labels), tuple(labels), seed, SAMPLING, TreeConfig(total_tokens=12, depth=3, topk=3), warmup)


def tokens_of(records):
    return [(r["sample"], r["label"], r["condition"], r["seed"], r["tokens"], r["stats"]["target_forwards"]) for r in records]


# ----------------------------------------------------------------------------- metrics


def numpy_frechet(a: torch.Tensor, b: torch.Tensor) -> float:
    """The textbook form, as a reference: tr sqrt(S1 S2) through sqrt(S1) S2 sqrt(S1)."""
    x, y = a.double().numpy(), b.double().numpy()
    s1, s2 = np.atleast_2d(np.cov(x, rowvar=False)), np.atleast_2d(np.cov(y, rowvar=False))
    w, v = np.linalg.eigh(s1)
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh(root @ s2 @ root), 0, None)).sum()
    return float(((x.mean(0) - y.mean(0)) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * tr_covmean)


def test_frechet_distance_matches_numpy_in_both_regimes_and_knows_its_counts():
    g = torch.Generator().manual_seed(0)
    for n, m, d in ((5, 40, 16), (60, 80, 4)):  # fewer samples than dimensions (nuclear-norm form), and more
        a, b = torch.randn(n, d, generator=g), torch.randn(m, d, generator=g) * 1.5 + 0.3
        fd = metrics.frechet_distance(a, b)
        assert (fd.n_a, fd.n_b) == (n, m)
        assert fd.value == pytest.approx(numpy_frechet(a, b), rel=1e-6, abs=1e-8)
    a = torch.randn(6, 32, generator=g)
    assert metrics.frechet_distance(a, a).value == pytest.approx(0.0, abs=1e-9)
    assert metrics.frechet_distance(a, a + 2.0).value == pytest.approx(4.0 * 32, rel=1e-6)
    with pytest.raises(SpecimgError, match="at least 2"):
        metrics.frechet_distance(a[:1], a)


def test_class_accuracy():
    assert metrics.class_accuracy(torch.tensor([1, 2, 3, 3]), [1, 2, 0, 3]) == 0.75


def test_log_likelihood_is_the_decoding_distribution_teacher_forced(models):
    target = models.target
    sampling = Sampling(temperature=0.9, top_k=50, cfg_scale=3.0, cfg_interval=20)
    tokens = Engine(target, None, "ar", sampling=sampling).generate([3], seed=1).tokens
    # the same quantity step by step through the KV-cache path the engine samples with
    out = target.prefill(3, sampling.cfg)
    logp = [probabilities(out.logits, sampling)[0, tokens[0, 0]].log()]
    depth, mask, root = torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long)
    for t in range(1, tokens.shape[1]):
        out = target.forward_tree(tokens[0, t - 1 : t], depth, mask)
        target.commit(root)
        logp.append(probabilities(out.logits, sampling, t - 1 <= sampling.cfg_interval)[0, tokens[0, t]].log())
    ll = metrics.token_log_likelihood(target, [3], tokens, sampling)
    assert float(ll.processed[0]) == pytest.approx(float(torch.stack(logp).mean()), abs=1e-4)
    plain = metrics.token_log_likelihood(target, [3], tokens, Sampling())
    assert torch.allclose(plain.processed, plain.raw, atol=1e-5) and torch.allclose(plain.raw, ll.raw)


# ----------------------------------------------------------------------------- prompts


def test_prompt_files_in_every_format(tmp_path):
    (tmp_path / "a.txt").write_text("a red cube\n\n a blue ball \n")
    (tmp_path / "b.jsonl").write_text('"plain string"\n{"caption": "x", "id": 4}\n{"prompt": "y"}\n')
    coco = {
        "images": [{"id": 7, "file_name": "7.jpg"}, {"id": 3, "file_name": "3.jpg"}],
        "annotations": [{"image_id": 7, "id": 20, "caption": "late"}, {"image_id": 7, "id": 11, "caption": "a dog "},
                        {"image_id": 3, "id": 30, "caption": "a cat"}],
    }
    (tmp_path / "captions_val2014.json").write_text(json.dumps(coco))
    (tmp_path / "PartiPrompts.tsv").write_text("Prompt\tCategory\tChallenge\tNote\nA tree\tOutdoor Scenes\tBasic\t\nA car\tVehicles\tBasic\tn\n")
    assert [p.text for p in prompts.read_prompts(tmp_path / "a.txt")] == ["a red cube", "a blue ball"]
    assert [p.text for p in prompts.read_prompts(tmp_path / "b.jsonl")] == ["plain string", "x", "y"]
    got = prompts.read_prompts(tmp_path / "captions_val2014.json")
    assert [(p.text, p.meta["image_id"], p.meta["file_name"]) for p in got] == [("a cat", 3, "3.jpg"), ("a dog", 7, "7.jpg")]
    parti = prompts.read_prompts(tmp_path / "PartiPrompts.tsv")
    assert [p.text for p in prompts.select_prompts(parti, 3, category="vehicles")] == ["A car"] * 3
    assert prompts.class_labels("4,1", 5, 10) == [4, 1, 4, 1, 4] and prompts.class_labels(None, 3, 2) == [0, 1, 0]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("missing.txt", None, "cannot read prompt file"),
        ("bad.jsonl", '{"caption": 1}\n', "no string field"),
        ("bad2.jsonl", "{not json\n", "not JSON"),
        ("captions.json", '{"images": []}', "not a COCO captions file"),
        ("PartiPrompts.tsv", "a\tb\n", "not PartiPrompts.tsv"),
        ("empty.txt", "\n\n", "holds no caption"),
        ("latin1.txt", b"caf\xe9", "cannot read prompt file"),
    ],
)
def test_unreadable_prompt_files_are_user_errors(tmp_path, name, text, message):
    if isinstance(text, bytes):
        (tmp_path / name).write_bytes(text)
    elif text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(SpecimgError, match=message):
        prompts.read_prompts(tmp_path / name)


def test_text_encoder_file_round_trip_and_left_padding(tmp_path):
    enc = text_encoder.HashTextEncoder(dim=12, max_length=8, seed=3)
    enc.save(tmp_path / "enc.safetensors")
    loaded = text_encoder.load_text_encoder(tmp_path / "enc.safetensors")
    caps = text_encoder.captions_for_target(loaded, ["one two three", "one"], length=6, dim=12)
    assert caps[0].mask.tolist() == [False] * 3 + [True] * 3 and caps[1].mask.tolist() == [False] * 5 + [True]
    assert torch.equal(caps[0].features[-1], enc.encode(["three"])[0][0, 0]) and caps[0].features[:3].abs().sum() == 0
    with pytest.raises(SpecimgError, match="expects 16-d"):
        text_encoder.captions_for_target(loaded, ["x"], 6, 16)
    (tmp_path / "junk.safetensors").write_bytes(b"nope")
    with pytest.raises(SpecimgError, match="cannot read text encoder"):
        text_encoder.load_text_encoder(tmp_path / "junk.safetensors")


# ----------------------------------------------------------------------------- variants


def test_variants_defaults_sweeps_and_errors():
    assert stack_members("cascade+lantern++", INSTALLED) == ["cascade", "lantern++"]
    assert stack_members("lantern+++cascade", INSTALLED) == ["lantern++", "cascade"]
    assert stack_members("lantern++", INSTALLED) == ["lantern++"]
    variants, notes = plan_variants(None, ["naive", "cascade", "lantern"])
    assert [v.label for v in variants] == ["ar", "naive", "lantern", "cascade", "cascade+lantern"]
    assert any("lantern++" in n for n in notes) and any("gsd" in n for n in notes)
    variants, notes = plan_variants(["cascade+lantern", "naive"], INSTALLED, {"lantern": {"k": "5"}}, ["cascade.delta=0.1,0.3", "delta=0.2,0.4"])
    assert [v.label for v in variants] == [
        "ar", "cascade+lantern cascade.delta=0.1 delta=0.2", "cascade+lantern cascade.delta=0.1 delta=0.4",
        "cascade+lantern cascade.delta=0.3 delta=0.2", "cascade+lantern cascade.delta=0.3 delta=0.4", "naive delta=0.2", "naive delta=0.4",
    ]
    assert "added ar" in notes[0]
    assert variants[2].options == {"lantern": {"k": "5"}, "cascade": {"delta": "0.1"}} and variants[2].delta == 0.4
    assert plan_variants(["cascade"], INSTALLED, sweeps=["cascade.delta=0.1,0.5"])[0][2].label == "cascade delta=0.5"
    for args, message in [
        ((["nope"], INSTALLED), "unknown method 'nope'"),
        ((["naive", "naive"], INSTALLED), "twice"),
        ((["naive"], INSTALLED, None, ["cascade.delta=0.1"]), "in no benchmarked stack"),
        ((["naive"], INSTALLED, {"gsd": {"w": "3"}}), "in no benchmarked stack"),
        ((["naive"], INSTALLED, None, ["cascade.delta"]), "--sweep takes"),
        ((["ar+naive"], INSTALLED), "cannot be stacked"),
    ]:
        with pytest.raises(SpecimgError, match=message):
            plan_variants(*args)


# ----------------------------------------------------------------------------- running


def test_interleaved_same_seeds_and_results_equal_separate_generation(models, tmp_path):
    variants, _ = plan_variants(["naive"], INSTALLED)
    spec = spec_for(variants, [2, 5, 2], seed=10)
    order = []
    run = run_bench(models, spec, tmp_path, state=OneProcess(), progress=False, on_record=lambda r: order.append((r["sample"], r["label"])))
    assert order == [(0, "ar"), (0, "naive"), (1, "naive"), (1, "ar"), (2, "ar"), (2, "naive")]  # image i by all before i+1
    assert run.computed == 6 and [r["seed"] for r in run.records] == [10, 10, 11, 11, 12, 12]
    for r in run.records:
        alone = run.engines[r["label"]].generate([r["condition"]], seed=r["seed"]).tokens[0].tolist()
        assert r["tokens"] == alone
    summary = summarise(run.records, spec, engines=run.engines)
    ar_row, naive_row = summary["variants"]
    assert ar_row["tau"] == 1.0 and ar_row["forwards_per_image"] == 64 and ar_row["speedup"] == pytest.approx(1.0)
    walls = {lab: sum(r["stats"]["wall_s"] for r in run.records if r["label"] == lab) for lab in ("ar", "naive")}
    assert naive_row["speedup"] == pytest.approx(walls["ar"] / walls["naive"])
    assert naive_row["tau"] == pytest.approx(3 * 64 / sum(r["stats"]["target_forwards"] for r in run.records if r["label"] == "naive"))
    assert naive_row["resolved"] == {"delta": 0.0, "options": {"naive": {}}, "budgeted": True} and naive_row["tvd"] == 0.0


def test_batch_sizes_run_in_blocks_against_ar_at_the_same_size(models, tmp_path):
    """Every method at every batch size (ar only above 1 so far), in blocks of the largest
    size; each image is the one of its seed, and a killed run resumes batch by batch."""
    variants, _ = plan_variants(["ar"], INSTALLED, batch_sizes=[1, 2])
    assert [(v.label, v.batch_size) for v in variants] == [("ar B=1", 1), ("ar B=2", 2)]
    spec = spec_for(variants, [2, 5, 2, 7, 1])
    order = []
    run = run_bench(models, spec, tmp_path / "run", state=OneProcess(), progress=False, on_record=lambda r: order.append((r["sample"], r["label"])))
    assert order == [(0, "ar B=1"), (1, "ar B=1"), (0, "ar B=2"), (1, "ar B=2"), (2, "ar B=2"), (3, "ar B=2"), (2, "ar B=1"), (3, "ar B=1"),
                     (4, "ar B=1"), (4, "ar B=2")]  # blocks of 2 samples, the first variant rotating with the block
    alone = Engine(models.target, method="ar", sampling=SAMPLING)
    for r in run.records:
        assert r["tokens"] == alone.generate([r["condition"]], seed=r["seed"]).tokens[0].tolist()
    one, two = summarise(run.records, spec)["variants"]
    assert (one["baseline"], two["baseline"], one["speedup"], two["speedup"]) == ("ar B=1", "ar B=2", 1.0, 1.0)
    assert two["images_per_s"] == pytest.approx(5 / sum(r["stats"]["wall_s"] for r in run.records if r["label"] == "ar B=2"))
    stopped = []

    def stop_in_a_batch(record):
        stopped.append(record)
        if len(stopped) == 5:  # the first record of the second B=2 batch: sample 3 is made alone on resuming
            raise Stop

    with pytest.raises(Stop):
        run_bench(models, spec, tmp_path / "killed", state=OneProcess(), progress=False, on_record=stop_in_a_batch)
    resumed = run_bench(models, spec, tmp_path / "killed", state=OneProcess(), progress=False)
    assert resumed.computed == 5 and tokens_of(resumed.records) == tokens_of(run.records)
    with pytest.raises(SpecimgError, match="distinct sizes"):
        plan_variants(["ar"], INSTALLED, batch_sizes=[2, 2])


def test_tvd_column_pools_the_budget_spent_per_emitted_token():
    variants, _ = plan_variants(["lantern"], INSTALLED)
    spec = spec_for(variants, [0, 1])

    def record(sample, label, accepted, tvd):
        stats = {"tokens": 10, "target_forwards": 5, "wall_s": 1.0, "seconds": {}, "accepted": accepted, "tree_sizes": [4] * len(accepted), "tvd": tvd}
        return {"sample": sample, "label": label, "stats": stats}

    records = [record(0, "ar", [], 0.0), record(0, "lantern", [2, 0], 0.1), record(1, "ar", [], 0.0), record(1, "lantern", [1], 0.4)]
    summary = summarise(records, spec)
    # lantern's steps emitted 3 + 1 tokens at 0.1 in image 0 and 2 at 0.4 in image 1
    assert [row["tvd"] for row in summary["variants"]] == [0.0, pytest.approx((4 * 0.1 + 2 * 0.4) / 6)]
    assert markdown_table(summary).splitlines()[0].startswith("| method | tree | tau | tvd |")
    assert "| 0.000 |" in markdown_table(summary) and "| 0.200 |" in markdown_table(summary)
    assert [row["tvd"] for row in csv.DictReader(io.StringIO(csv_text(summary)))] == ["0.0", str((4 * 0.1 + 2 * 0.4) / 6)]
    older = [{**r, "stats": {k: v for k, v in r["stats"].items() if k != "tvd"}} for r in records]  # written before tvd was kept
    assert [row["tvd"] for row in summarise(older, spec)["variants"]] == [None, None]


def test_the_summary_pools_each_variant_through_run_stats():
    """Rows from the records' statistics as the manifest holds them, auto trees included."""
    ar = ImageStats(tokens=64, target_forwards=64, wall=2.0, seconds={"verify": 1.5})
    first = ImageStats(
        tokens=64, target_forwards=20, tree_sizes=[12] * 5 + [9] * 14, accepted=[4] * 5 + [2] * 14, seconds={"draft": 0.25, "verify": 0.5},
        wall=0.75, trees=[[0, 3, 3, 12], [5, 4, 2, 9]], predicted_ms=30.0, predicted_ar_ms=90.0,
    )
    second = ImageStats(tokens=64, target_forwards=11, tree_sizes=[9] * 10, accepted=[5] * 10, seconds={"draft": 0.5}, wall=0.25, trees=[[0, 4, 2, 9]], predicted_ms=10.0, predicted_ar_ms=70.0)
    for image in (ar, first, second):
        assert ImageStats.from_dict(json.loads(json.dumps(image.as_dict()))) == image
    variants, _ = plan_variants(["naive"], INSTALLED)
    records = [{"label": label, "stats": image.as_dict()} for label, image in (("ar", ar), ("naive", first), ("ar", ar), ("naive", second))]
    ar_row, naive_row = summarise(records, spec_for(variants, [0, 1]))["variants"]
    assert (ar_row["tree"], ar_row["predicted_speedup"], ar_row["mean_tree_size"]) == ("-", None, 0.0)
    assert naive_row["tree"] == "auto 4/2/9"  # 24 of the 29 steps
    assert naive_row["predicted_speedup"] == 160.0 / 40.0 and naive_row["mean_tree_size"] == (5 * 12 + 24 * 9) / 29
    assert naive_row["tau"] == 128 / 31 and naive_row["forwards_per_image"] == 15.5 and naive_row["speedup"] == 4.0 / 1.0
    assert naive_row["mean_accepted"] == (5 * 4 + 14 * 2 + 10 * 5) / 29 and naive_row["wall_per_image_s"] == 0.5
    assert naive_row["phase_s_per_image"] == {"draft": 0.375, "verify": 0.25, "relax": 0.0, "accept": 0.0, "commit": 0.0}


class Stop(Exception):
    pass


def test_a_killed_run_resumes_without_redoing_or_losing_samples(models, tmp_path):
    variants, _ = plan_variants(["naive"], INSTALLED)
    spec = spec_for(variants, [1, 2, 3])
    full = run_bench(models, spec, tmp_path / "full", state=OneProcess(), progress=False)

    def stop_after(k):
        seen = []

        def hook(record):
            seen.append(record)
            if len(seen) == k:
                raise Stop

        return hook

    out = tmp_path / "killed"
    with pytest.raises(Stop):
        run_bench(models, spec, out, state=OneProcess(), progress=False, on_record=stop_after(3))
    with open(out / "manifest.jsonl", "a") as fh:  # a kill in the middle of writing a line
        fh.write('{"index": 4, "sample": 2, "tok')
    resumed = run_bench(models, spec, out, state=OneProcess(), progress=False)
    assert resumed.computed == 3
    assert tokens_of(resumed.records) == tokens_of(full.records)
    assert run_bench(models, spec, out, state=OneProcess(), progress=False).computed == 0
    # more images extend the run; other settings are refused
    more = spec_for(variants, [1, 2, 3, 4])
    assert run_bench(models, more, out, state=OneProcess(), progress=False).computed == 2
    with pytest.raises(SpecimgError, match="other settings"):
        run_bench(models, spec_for(variants, [1, 2, 3], seed=7), out, state=OneProcess(), progress=False)
    with pytest.raises(SpecimgError, match="condition"):
        run_bench(models, spec_for(variants, [9, 2, 3]), out, state=OneProcess(), progress=False)


def _two_process_worker(out: str) -> None:
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # forked from a process with a single-process state
    state = PartialState(cpu=True)
    torch.set_num_threads(1)  # after PartialState, which sets (host cores / processes) threads
    variants, _ = plan_variants(["naive"], INSTALLED)
    run = run_bench(loading.tiny_random(), spec_for(variants, [0, 7, 3]), out, state=state, progress=False)
    with open(os.path.join(out, f"gathered-{state.process_index}.json"), "w") as fh:
        json.dump({"world": state.num_processes, "computed": run.computed, "records": tokens_of(run.records)}, fh)


def test_two_processes_gather_what_one_process_computes(models, tmp_path):
    from accelerate import debug_launcher

    variants, _ = plan_variants(["naive"], INSTALLED)
    one = run_bench(models, spec_for(variants, [0, 7, 3]), tmp_path / "one", state=OneProcess(), progress=False)
    out = tmp_path / "two"
    debug_launcher(_two_process_worker, args=(str(out),), num_processes=2)
    r0, r1 = (json.loads((out / f"gathered-{r}.json").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    assert (r0["computed"], r1["computed"]) == (4, 2)  # samples 0 and 2, and sample 1
    expected = [list(x) for x in tokens_of(one.records)]
    assert r0["records"] == r1["records"] == expected
    assert sorted(os.listdir(out)) == ["gathered-0.json", "gathered-1.json", "manifest-1.jsonl", "manifest.jsonl"]
    # the two-process manifests resume on one process with nothing left to do
    variants, _ = plan_variants(["naive"], INSTALLED)
    again = run_bench(models, spec_for(variants, [0, 7, 3]), out, state=OneProcess(), progress=False)
    assert again.computed == 0 and tokens_of(again.records) == tokens_of(one.records)


# ----------------------------------------------------------------------------- quality and outputs


def test_quality_with_a_classifier_and_outputs(models, tmp_path):
    from specimg.eval.classifier import DemoClassifier

    variants, _ = plan_variants(["naive"], INSTALLED)
    spec = spec_for(variants, [7, 1, 7, 3])  # the untrained classifier below calls most images a 7
    run = run_bench(models, spec, tmp_path, state=OneProcess(), progress=False)
    torch.manual_seed(0)
    classifier = DemoClassifier(num_classes=10, width=8).eval()

    def real(n, seed):
        return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1

    quality = Quality(models.target, models.tokenizer, SAMPLING, list(spec.conditions), classifier=classifier, real_images=real, num_real=20)
    summary = summarise(run.records, spec, quality, run.engines)
    ar_q, naive_q = (row["quality"] for row in summary["variants"])
    assert ar_q["frechet_ar"]["value"] == pytest.approx(0.0, abs=1e-6)
    assert naive_q["frechet_real"]["n_a"] == 4 and naive_q["frechet_real"]["n_b"] == 20
    naive_tokens = torch.tensor([r["tokens"] for r in run.records if r["label"] == "naive"])
    with torch.no_grad():
        predicted = classifier.predict(models.tokenizer.decode(naive_tokens).clamp(-1, 1))
    assert naive_q["accuracy"] == pytest.approx((predicted == torch.tensor(spec.conditions)).float().mean().item())
    assert naive_q["loglik"] < 0
    assert summary["floors"]["frechet_real"]["n_a"] == 4
    # the AR floor: AR on other seeds against the run's AR samples, what an exact sampler scores
    run_ar = torch.tensor([r["tokens"] for r in run.records if r["label"] == "ar"])
    again = ar_tokens(models.target, list(spec.conditions), [AR_FLOOR_SEED + i for i in range(4)], SAMPLING)
    with torch.no_grad():
        features = [classifier.all_features(models.tokenizer.decode(t).clamp(-1, 1)) for t in (again, run_ar)]
    assert summary["floors"]["frechet_ar"]["value"] == pytest.approx(frechet_distance(*features).value, rel=1e-5)
    assert summary["floors"]["frechet_ar"]["value"] > 0
    paths = write_outputs(summary, spec, tmp_path, {"model": models.name})
    doc = json.loads(open(paths["json"]).read())
    assert doc["plot_metric"] == "frechet_real" and doc["settings"]["num_images"] == 4
    rows = list(csv.DictReader(open(paths["csv"])))
    assert [r["label"] for r in rows] == ["ar", "naive"] and float(rows[0]["speedup"]) == pytest.approx(1.0)
    table = open(paths["md"]).read()
    assert "FD real (n=4 vs 20)" in table and "| naive |" in table
    assert Image.open(paths["png"]).size == (800, 560)


def test_t2i_bench_from_captions(tmp_path):
    from specimg.models.eagle import build_drafter
    from specimg.models.llamagen import build_target

    target = build_target("GPT-B", seed=0, **{**loading.TINY_GPT, "model_type": "t2i", "cls_token_num": 4, "caption_dim": 12, "block_size": 16})
    models = loading.Models(target, build_drafter(target, seed=1), None, "tiny-t2i")
    (tmp_path / "p.txt").write_text("a red cube\na dog on grass\n")
    enc = text_encoder.HashTextEncoder(dim=12)
    enc.save(tmp_path / "enc.safetensors")
    from specimg.cli.conditions import conditions_for

    kw = {"num_images": 3, "prompts": str(tmp_path / "p.txt"), "text_encoder": str(tmp_path / "enc.safetensors"), "class_labels": None}
    conditions, keys, captions = conditions_for(models.target, kw)
    assert keys == captions == ["a red cube", "a dog on grass", "a red cube"] and isinstance(conditions[0], Caption)
    variants, _ = plan_variants(["naive"], INSTALLED)
    spec = BenchSpec(tuple(variants), tuple(conditions), tuple(keys), 0, SAMPLING, TreeConfig(total_tokens=8, depth=2, topk=2), 0)
    run = run_bench(models, spec, tmp_path / "o", state=OneProcess(), progress=False)
    summary = summarise(run.records, spec, Quality(target, None, SAMPLING, conditions, captions=captions))
    assert all(np.isfinite(row["quality"]["loglik"]) for row in summary["variants"])
    with pytest.raises(SpecimgError, match="needs --prompts"):
        conditions_for(models.target, {**kw, "prompts": None})


def test_fid_and_clip_through_torchmetrics_with_stand_in_models(tmp_path):
    pytest.importorskip("torchmetrics")
    from specimg.eval.clip import CLIPScorer
    from specimg.eval.fid import FID, load_feature_extractor, read_image_folder

    class Features(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.float() / 255.0
            return torch.cat([x.mean(dim=(2, 3)), x.std(dim=(2, 3)), x[:, :, ::4, ::4].flatten(1)[:, :10]], dim=1)

    torch.jit.script(Features()).save(str(tmp_path / "feat.pt"))
    extractor = load_feature_extractor(str(tmp_path / "feat.pt"), image_size=16)
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        Image.fromarray((torch.rand(20, 24, 3, generator=g) * 255).byte().numpy()).save(tmp_path / f"{i}.png")
    real = read_image_folder(tmp_path, size=16)
    assert real.shape == (6, 3, 16, 16) and real.dtype == torch.uint8
    fid = FID(extractor, real)
    same = fid(real)
    assert same.value == pytest.approx(0.0, abs=1e-3) and (same.n_a, same.n_b) == (6, 6)
    fake = torch.rand(5, 3, 16, 16, generator=g) * 2 - 1
    expected = metrics.frechet_distance(extractor(((fake + 1) * 127.5).round().byte()), extractor(real)).value
    assert fid(fake).value == pytest.approx(expected, rel=1e-3)
    with pytest.raises(SpecimgError, match="not a TorchScript"):
        load_feature_extractor(str(tmp_path / "0.png"))

    class Model(torch.nn.Module):
        config = None

        def get_image_features(self, pixels):
            return pixels.flatten(1)[:, :4] + 1.0

        def get_text_features(self, ids, mask):
            return ids[:, :4].float() + 1.0

    def processor(text=None, images=None, **_):
        if images is not None:
            return {"pixel_values": torch.stack([im.float() for im in images])}
        ids = torch.tensor([[len(t), 1, 2, 3] for t in text])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    score = CLIPScorer(lambda: (Model(), processor))(torch.zeros(2, 3, 4, 4), ["ab", "abc"])
    assert 0 < score <= 100


# ----------------------------------------------------------------------------- CLI


def run_cli(*args: str) -> int:
    from specimg.cli import main

    try:
        main(list(args))
    except SystemExit as stop:
        return int(stop.code)
    return 0


def test_cli_bench_writes_table_json_csv_and_plot(tmp_path, capsys):
    out = tmp_path / "b"
    args = ["bench", "--model", "tiny-random", "-n", "2", "--methods", "naive", "--warmup", "0", "--total-tokens", "8", "--depth", "2", "--out", str(out)]
    assert run_cli(*args) == 0
    printed = capsys.readouterr().out
    assert "| ar |" in printed and "| naive |" in printed and "speedup" in printed
    assert {"bench.json", "bench.csv", "bench.md", "bench.png", "samples.png", "manifest.jsonl"} <= set(os.listdir(out))
    doc = json.loads((out / "bench.json").read_text())
    assert [v["label"] for v in doc["variants"]] == ["ar", "naive"] and doc["computed_this_run"] == 4
    assert run_cli(*args) == 0 and json.loads((out / "bench.json").read_text())["computed_this_run"] == 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--methods", "naive,nope"], "unknown method 'nope'"),
        (["--methods", "naive", "--sweep", "cascade.delta=0.1"], "in no benchmarked stack"),
        (["--methods", "naive", "--sweep", "naive"], "--sweep takes"),
        (["--methods", "cascade", "--sweep", "cascade.delta=x"], "not a valid finite float"),
        (["--methods", "naive", "--prompts", "p.txt"], "needs a t2i target"),
        (["--methods", "naive", "--fid-features", "missing.pt"], "no feature extractor file"),
        (["--methods", "naive,"], "--methods 'naive,' has an empty item"),
        (["--methods", ""], "--methods '' names nothing"),
        (["--methods", "naive", "--batch-size", "1,,2"], "--batch-size '1,,2' has an empty item"),
        (["--methods", "naive", "--sweep", "delta=0.1,,0.2"], "--sweep takes"),
        (["--methods", "naive", "--real-images", "."], "give --fid-features too"),
        (["--methods", "naive", "--real-images", "missing"], "does not exist"),
    ],
)
def test_cli_bench_user_errors_are_one_line(tmp_path, capsys, extra, message):
    assert run_cli("bench", "--model", "tiny-random", "-n", "1", "--out", str(tmp_path / "o"), *extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # a refused run creates nothing


def test_the_plot_draws_each_finite_point_and_lists_the_others(tmp_path):
    from specimg.eval.bench import scatter_plot

    path = tmp_path / "p.png"
    assert scatter_plot([("ar", 1.0, 1.0), ("naive", 2.0, 1.5), ("broken", float("nan"), 2.0)], path, "x", "y", hline=1.0)
    img = Image.open(path).convert("RGB")
    assert img.size == (800, 560)
    colours = {colour for _, colour in img.getcolors(800 * 560)}
    assert {(31, 119, 180), (255, 127, 14)} <= colours  # C0 and C1: the two finite points
    assert (44, 160, 44) not in colours  # C2 would be a third point
    assert any(r > 150 and g < 30 and b < 30 for r, g, b in colours)  # the red "not plotted" line


def test_bench_without_matplotlib_writes_all_but_the_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    out = tmp_path / "b"
    args = ["bench", "--model", "tiny-random", "-n", "1", "--methods", "naive", "--warmup", "0", "--no-quality", "--out", str(out)]
    assert run_cli(*args) == 0
    assert "note: no bench.png: the plot needs matplotlib (pip install 'specimg[plot]')" in capsys.readouterr().out
    assert {"bench.json", "bench.csv", "bench.md"} <= set(os.listdir(out)) and "bench.png" not in os.listdir(out)
