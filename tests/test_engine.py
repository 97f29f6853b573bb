"""The engine on tiny LlamaGen models with EAGLE-1 and EAGLE-3 drafters: greedy speculative
decoding reproduces AR."""

import pytest
import torch

import specimg
from specimg.errors import SpecimgError
from specimg.models.base import Caption
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target
from specimg.models.loading import TINY_VQ
from specimg.models.vq import build_tokenizer

TINY = dict(dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=64, num_classes=5, block_size=16)


@pytest.fixture(scope="module", params=["eagle1", "eagle3"])
def models(request):
    target = build_target("GPT-B", seed=0, **TINY)
    return target, build_drafter(target, seed=1, kind=request.param)


GREEDY = specimg.Sampling(temperature=0.0, cfg_scale=3.0)


@pytest.mark.parametrize(
    "tree",
    [
        specimg.TreeConfig(depth=4, topk=4, total_tokens=20),
        specimg.TreeConfig(kind="chain", depth=3),
        specimg.TreeConfig(kind="static", rank_paths=((0,), (1,), (0, 0), (1, 0), (0, 0, 0))),
    ],
    ids=["dynamic", "chain", "static"],
)
def test_greedy_naive_equals_greedy_ar(models, tree):
    target, drafter = models
    ar = specimg.Engine(target, method="ar", sampling=GREEDY).generate(list(range(5)) * 2, seed=3)
    spec = specimg.Engine(target, drafter, method="naive", sampling=GREEDY, tree=tree).generate(list(range(5)) * 2, seed=3)
    assert torch.equal(spec.tokens, ar.tokens)
    assert spec.stats.target_forwards <= ar.stats.target_forwards


@pytest.mark.parametrize("method", ["naive", "lantern", "lantern++", "gsd", "cascade", "cascade+lantern", "lantern+gsd"])
def test_an_eagle3_drafter_decodes_with_every_method(method):
    """At budget 0 every method's greedy tokens are AR's; at its own budget it makes an image."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1, kind="eagle3")
    tokenizer = build_tokenizer(seed=2, **dict(TINY_VQ, codebook_size=TINY["vocab_size"]))
    tree = specimg.TreeConfig(depth=3, topk=2, total_tokens=8)
    ar = specimg.Engine(target, method="ar", sampling=GREEDY).generate([0, 3], seed=3)
    exact = specimg.Engine(target, drafter, method, sampling=GREEDY, tree=tree, delta=0.0, tokenizer=tokenizer).generate([0, 3], seed=3)
    assert torch.equal(exact.tokens, ar.tokens) and sum(exact.stats.images[0].accepted) > 0
    relaxed = specimg.Engine(target, drafter, method, tree=tree, tokenizer=tokenizer).generate([1], seed=4)
    image = tokenizer.decode(relaxed.tokens)
    assert image.shape == (1, 3, 16, 16) and bool(image.isfinite().all())


def test_drafter_equal_to_target_accepts_whole_chains(models):
    """A drafter that is the target's own greedy oracle is accepted every time: tau = depth + 1."""
    target, _ = models

    class Oracle:
        vocab_size = target.vocab_size

        def prefill(self, condition, cfg):
            self.condition, self.tokens = condition, []

        def _next(self, tokens):
            # forward_sequence's entry t predicts token t: append a placeholder to read the next one
            out = target.forward_sequence(torch.tensor([self.condition]), torch.tensor([tokens + [0]]))
            return out.logits[:, -1]

        def start(self, hidden, tokens):
            self.tokens += tokens.tolist()
            self.fed = [list(self.tokens)]
            return self._next(self.tokens)

        def expand(self, parents, tokens):
            rows = []
            for parent, token in zip(parents.tolist(), tokens.tolist()):
                self.fed.append(self.fed[parent] + [token])
                rows.append(self._next(self.fed[-1]))
            return torch.stack(rows, dim=1)

    greedy = specimg.Sampling(temperature=0.0)
    tree = specimg.TreeConfig(kind="chain", depth=4)
    with torch.no_grad():
        ar = specimg.Engine(target, method="ar", sampling=greedy).generate([2], seed=0)
        out = specimg.Engine(target, Oracle(), method="naive", sampling=greedy, tree=tree).generate([2], seed=0)
    assert torch.equal(out.tokens, ar.tokens)
    # 1 prefill token, then 15 tokens in steps of 5 (4 accepted + 1 bonus)
    assert out.stats.images[0].accepted == [4, 4, 4]
    assert out.stats.target_forwards == 4


def test_sampling_is_deterministic_per_seed_and_independent_of_batching(models):
    target, drafter = models
    engine = specimg.Engine(target, drafter, method="naive", sampling=specimg.Sampling(cfg_scale=2.0, top_k=20))
    both = engine.generate([1, 4], seed=7).tokens
    assert torch.equal(engine.generate([1, 4], seed=7).tokens, both)
    assert torch.equal(engine.generate([4], seed=8).tokens[0], both[1])


def test_stats_account_for_every_token(models):
    target, drafter = models
    drafting = specimg.TreeConfig(ar_fallback=False)  # a random drafter pays nowhere: every step drafts all the same
    out = specimg.Engine(target, drafter, method="naive", tree=drafting).generate([0, 1], seed=0)
    for image in out.stats.images:
        assert image.tokens == target.num_tokens
        assert image.target_forwards == 1 + len(image.accepted)
        assert image.tokens == 1 + sum(a + 1 for a in image.accepted)
        assert set(image.seconds) == set(specimg.stats.PHASES)


def test_t2i_target_runs_through_the_engine():
    target = build_target("GPT-B", seed=0, **{**TINY, "model_type": "t2i", "cls_token_num": 6, "caption_dim": 12})
    drafter = build_drafter(target, seed=1)
    features = torch.randn(6, 12, generator=torch.Generator().manual_seed(0))
    caption = Caption(features, torch.tensor([0, 0, 1, 1, 1, 1]))
    greedy = specimg.Sampling(temperature=0.0, cfg_scale=2.0)
    ar = specimg.Engine(target, method="ar", sampling=greedy).generate([caption], seed=0)
    spec = specimg.Engine(target, drafter, method="naive", sampling=greedy).generate([caption], seed=0)
    assert torch.equal(ar.tokens, spec.tokens)


def test_a_budget_nothing_spends_leaves_acceptance_exact(models):
    """naive relaxes nothing, so a budget given to it changes no acceptance: the same
    recursive rejection, the same tokens, seed for seed (sampled, dynamic trees)."""
    target, drafter = models
    sampling = specimg.Sampling(temperature=1.0, cfg_scale=3.0)
    tree = specimg.TreeConfig(depth=3, topk=3, total_tokens=10)
    exact = specimg.Engine(target, drafter, method="naive", sampling=sampling, tree=tree)
    budgeted = specimg.Engine(target, drafter, method="naive", sampling=sampling, tree=tree, delta=0.5)
    assert exact.exact and budgeted.exact
    assert torch.equal(budgeted.generate([0, 1, 2], seed=5).tokens, exact.generate([0, 1, 2], seed=5).tokens)
    assert not specimg.Engine(target, drafter, method="lantern", sampling=sampling, tree=tree).exact


def test_user_errors_are_specimg_errors(models):
    target, drafter = models
    with pytest.raises(SpecimgError, match="needs a drafter"):
        specimg.Engine(target, method="naive")
    with pytest.raises(SpecimgError, match="unknown method"):
        specimg.Engine(target, drafter, method="naive+nothing")
    with pytest.raises(SpecimgError, match="takes no options"):
        specimg.Engine(target, method="ar", options={"naive": {}})
    with pytest.raises(SpecimgError, match="no total-variation budget"):
        specimg.Engine(target, method="ar", delta=0.5)

    class WrongVocab:
        vocab_size = 7

    with pytest.raises(SpecimgError, match="vocabulary of 7"):
        specimg.Engine(target, drafter, tokenizer=WrongVocab())


def test_sampled_naive_reproduces_ar_tokens_seed_for_seed(models):
    """With top-k drafts, sample-and-match draws once per generated token, in order, from the
    same distribution AR samples from: the same seed gives AR's very tokens."""
    target, drafter = models
    sampling = specimg.Sampling(cfg_scale=3.0, top_k=30)
    ar = specimg.Engine(target, method="ar", sampling=sampling).generate(list(range(5)) * 2, seed=11)
    drafting = specimg.TreeConfig(ar_fallback=False)  # auto trees that keep drafting where none pays
    spec = specimg.Engine(target, drafter, method="naive", sampling=sampling, tree=drafting).generate(list(range(5)) * 2, seed=11)
    assert spec.stats.mean_accepted > 0  # drafts were accepted, not only corrections drawn
    assert torch.equal(spec.tokens, ar.tokens)


def test_device_and_dtype_follow_the_engine_arguments():
    """bfloat16 weights on the CPU: models are cast, probabilities stay float32, and the
    same seed gives the same images."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    engine = specimg.Engine(target, drafter, "naive", sampling=specimg.Sampling(cfg_scale=2.0), device="cpu", dtype=torch.bfloat16)
    assert engine.device == torch.device("cpu")
    assert target.tok_embeddings.weight.dtype == torch.bfloat16 and drafter.fc.weight.dtype == torch.bfloat16
    out = engine.generate([1, 2], seed=5)
    assert out.tokens.shape == (2, target.num_tokens)
    assert torch.equal(engine.generate([2], seed=6).tokens[0], out.tokens[1])
