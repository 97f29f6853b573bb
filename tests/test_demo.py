"""The embedded demo: data generator, the toy-scale recipe end to end, the shipped bundle."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("skimage")

from specimg.demo.data import NUM_CLASSES, make_dataset  # noqa: E402
from specimg.errors import SpecimgError  # noqa: E402


def test_data_is_deterministic_balanced_and_in_range() -> None:
    x1, y1 = make_dataset(60, seed=3)
    x2, y2 = make_dataset(60, seed=3, chunk=7)  # chunking never changes the result
    assert x1.shape == (60, 3, 64, 64) and y1.shape == (60,)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.bincount(y1, minlength=NUM_CLASSES).tolist() == [6] * NUM_CLASSES
    assert x1.min() >= -1 and x1.max() <= 1 and x1.std() > 0.1
    x3, _ = make_dataset(60, seed=4)
    assert not torch.equal(x1, x3)
    xt, yt = make_dataset(20, seed=3, split="test")
    assert torch.bincount(yt, minlength=NUM_CLASSES).tolist() == [2] * NUM_CLASSES
    assert not torch.equal(xt[:20], x1[:20])
    # the target's split holds GLYPHS_PER_CLASS handwritten instances per class; None = all
    xa, ya = make_dataset(60, seed=3, glyphs_per_class=None)
    assert torch.equal(ya, y1) and not torch.equal(xa, x1)
    with pytest.raises(SpecimgError, match="glyphs_per_class"):
        make_dataset(4, glyphs_per_class=0)


def test_toy_recipe_end_to_end(tmp_path) -> None:
    from click.testing import CliRunner

    from specimg.cli import cli
    from specimg.config import Sampling, TreeConfig
    from specimg.engine import Engine
    from specimg.models.demo import load_demo

    result = CliRunner().invoke(cli, ["train-demo", "--out", str(tmp_path), "--scale", "toy", "--threads", "1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert set(manifest["stages"]) >= {
        "tokenizer", "tokens", "target", "classifier", "drafter", "drafter-cascade", "drafter-data-eagle3", "drafter-eagle3", "quality",
    }
    assert manifest["stages"]["drafter-eagle3"]["drafter_type"] == "eagle3" and "drafter-eagle3.safetensors" in manifest["files"]
    assert not (tmp_path / "work").exists()
    models = load_demo(tmp_path)
    assert models.name == "demo" and models.tokenizer is not None and models.drafter is not None
    eagle3 = load_demo(tmp_path, drafter="eagle3")
    assert eagle3.drafter.kind == "eagle3" and eagle3.drafter.feature_layers == (0, 1, 1)  # the toy target's 2 layers
    greedy = Sampling(temperature=0.0, cfg_scale=2.0)
    ar = Engine(eagle3.target, None, "ar", sampling=greedy).generate([4], seed=0).tokens
    assert torch.equal(Engine(eagle3.target, eagle3.drafter, "naive", sampling=greedy, tree=TreeConfig(depth=3, topk=2, total_tokens=6)).generate([4], seed=0).tokens, ar)
    from specimg.eval.classifier import load_classifier

    classifier = load_classifier(os.path.join(tmp_path, "classifier.safetensors"))
    assert classifier.num_classes == NUM_CLASSES
    # the recorded accuracy is the bundle's own: its AR samples (toy scale: one per class,
    # seeds 10000 + i, at the chosen sampling), decoded and classified again here
    quality = manifest["stages"]["quality"]
    engine = Engine(models.target, None, "ar", sampling=Sampling(quality["temperature"], cfg_scale=quality["cfg_scale"], top_k=quality["top_k"]))
    wanted = list(range(NUM_CLASSES))
    codes = torch.cat([engine.generate([c], seed=10_000 + i).tokens for i, c in enumerate(wanted)])
    with torch.no_grad():
        predicted = classifier.predict(models.tokenizer.decode(codes).clamp(-1, 1))
    assert quality["classifier_acc_ar_samples"] == round((predicted == torch.tensor(wanted)).float().mean().item(), 4)
    assert quality["per_class_acc_ar_samples"] == {str(c): float(predicted[c] == c) for c in wanted}
    # a second run on the finished folder resumes: every stage is skipped
    again = CliRunner().invoke(cli, ["train-demo", "--out", str(tmp_path), "--scale", "toy"], catch_exceptions=False)
    assert again.exit_code == 0 and "skipping" in again.output
    gen = Engine(models.target, None, "ar").generate([3], seed=0)
    assert gen.tokens.shape == (1, 256)


def test_the_default_scale_records_itself_as_the_shipped_bundle_did() -> None:
    """The shipped bundle is what ``specimg train-demo`` with no --scale makes, recorded the same way."""
    import specimg.demo
    from specimg.demo.recipe import DEFAULT_SCALE as default
    from specimg.demo.recipe import SCALES

    with open(os.path.join(os.path.dirname(specimg.demo.__file__), "bundle", "manifest.json")) as fh:
        shipped = json.load(fh)["scale"]
    assert shipped["name"] == default
    assert json.dumps(SCALES[default].record()) == json.dumps(shipped)


def test_wrong_scale_on_existing_folder_is_a_user_error(tmp_path, capsys) -> None:
    from specimg.cli import main

    (tmp_path / "manifest.json").write_text(json.dumps({"scale": {"name": "compact"}, "stages": {}}))
    with pytest.raises(SystemExit) as stop:
        main(["train-demo", "--out", str(tmp_path), "--scale", "toy"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"specimg: error: {tmp_path} holds a bundle of scale compact, not toy; give another --out or --scale compact\n"


def test_shipped_bundle_loads_and_generates() -> None:
    from specimg.engine import Engine
    from specimg.models.demo import bundle_exists, demo_sampling, load_demo

    if not bundle_exists():
        pytest.skip("the demo bundle is not installed (run specimg train-demo --out specimg/demo/bundle)")
    models = load_demo()
    assert models.name == "demo" and models.target.config.num_classes == NUM_CLASSES
    assert models.target.vocab_size == models.tokenizer.vocab_size
    engine = Engine(models.target, models.drafter, "ar", sampling=demo_sampling(), tokenizer=models.tokenizer)
    out = engine.generate([7], seed=0)
    assert out.tokens.shape == (1, models.target.num_tokens)
    with torch.inference_mode():
        img = models.tokenizer.decode(out.tokens)
    assert img.shape == (1, 3, 64, 64)


def test_split_codebook_makes_equiangular_siblings_around_each_code() -> None:
    import math

    from specimg.demo.recipe import split_codebook
    from specimg.models.vq import build_tokenizer

    tok = build_tokenizer(seed=1, codebook_size=16, codebook_embed_dim=4, ch=8, encoder_ch_mult=(1, 2), decoder_ch_mult=(1, 2),
                          z_channels=8, num_res_blocks=1, norm_groups=4)
    split = split_codebook(tok, 4, 5.0, seed=2)
    assert split.vocab_size == 64
    parents, children = tok.codebook_vectors(), split.codebook_vectors().view(16, 4, 4)
    theta = math.radians(5.0)
    # every child sits theta from its code, and siblings sit equally far apart (a regular simplex)
    assert torch.allclose(torch.einsum("nd,nkd->nk", parents, children), torch.full((16, 4), math.cos(theta)), atol=1e-5)
    sibling = math.cos(theta) ** 2 - math.sin(theta) ** 2 / 3
    cos = torch.einsum("nkd,njd->nkj", children, children)
    off = ~torch.eye(4, dtype=torch.bool).expand(16, 4, 4)
    assert torch.allclose(cos[off], torch.full_like(cos[off], sibling), atol=1e-5)
    # encoder and decoder untouched; the encoder mostly stays in the code it chose before
    state, new = tok.state_dict(), split.state_dict()
    assert all(torch.equal(state[k], new[k]) for k in state if k != "quantize.embedding.weight")
    images, _ = make_dataset(4, seed=0)
    assert (split.encode(images) // 4 == tok.encode(images)).float().mean() >= 0.8
    with pytest.raises(SpecimgError, match="1 < split <= its width 4"):
        split_codebook(tok, 5, 5.0, seed=2)


def test_draw_siblings_keeps_the_cluster_and_forgets_the_encoders_sibling() -> None:
    from scipy.stats import chisquare

    from specimg.demo.recipe import draw_siblings

    codes = torch.randint(0, 4096, (100, 256), generator=torch.Generator().manual_seed(0))
    drawn = draw_siblings(codes, 8, seed=5)
    assert torch.equal(drawn // 8, codes // 8)
    # the draw reads only the cluster: the encoder's sibling leaves no trace
    assert torch.equal(drawn, draw_siblings(codes // 8 * 8, 8, seed=5))
    # uniform over the 8 siblings: a false failure once in a million seeds
    assert chisquare(torch.bincount(drawn.flatten() % 8, minlength=8).numpy()).pvalue > 1e-6


def test_split_target_shares_each_clusters_probability_equally_among_its_siblings() -> None:
    from specimg.demo.recipe import draw_siblings, split_target
    from specimg.models.llamagen import build_target

    clusters = build_target("GPT-B", seed=3, dim=32, n_layer=2, n_head=2, multiple_of=16, vocab_size=16, num_classes=10, block_size=16)
    target = split_target(clusters, 4)
    assert target.vocab_size == 64
    labels, codes = torch.tensor([1, 7]), torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = clusters.forward_sequence(labels, codes).logits.softmax(-1)
        after = target.forward_sequence(labels, draw_siblings(codes * 4, 4, seed=1)).logits.softmax(-1).unflatten(-1, (16, 4))
    assert torch.allclose(after, (before / 4)[..., None].expand_as(after), atol=1e-6)
