"""LANTERN's drafter folders load (``specimg.models.load_drafter``, ``--drafter FOLDER``):
their logits (the first, and at every image token) match a transcription of LANTERN's
drafter forward over the caption pairs, greedy naive decoding with them equals greedy ar,
and what does not fit is refused."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from cli_runner import one_line_error, run
from lantern_files import DRAFTER, write_drafter, write_target
from test_lantern import GREEDY, caption

from specimg.engine import Engine
from specimg.errors import SpecimgError
from specimg.models import load_drafter, load_target
from specimg.models.drafter_folder import FolderDrafter
from specimg.models.eagle import save_drafter
from specimg.models.llamagen import build_target
from specimg.models.loading import TINY_VQ
from specimg.models.text_encoder import HashTextEncoder
from specimg.models.vq import build_tokenizer, save_tokenizer


def lantern_rope(head_dim: int, grid: int, zeros: int) -> torch.Tensor:
    """LANTERN's drafter table (base 10000): ``zeros`` rows of (0, 0), then the grid's cells,
    the first head_dim/4 pairs by row, the rest by column."""
    half = head_dim // 2
    freqs = 1.0 / (10000 ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    angles = torch.outer(torch.arange(grid).float(), freqs)
    cells = torch.cat([angles[:, None].expand(-1, grid, -1), angles[None].expand(grid, -1, -1)], dim=-1).flatten(0, 1)
    return torch.cat([torch.zeros(zeros, half, 2), torch.stack([cells.cos(), cells.sin()], dim=-1)])


def lantern_draft_logits(w: dict, hidden: torch.Tensor, ids: torch.Tensor, head: torch.Tensor, grid: int = 16) -> torch.Tensor:
    """LANTERN's drafter forward, transcribed: pairs (hidden p, ids p) at rows 0.. of its own
    table (119 zero rows, then the ``grid`` x ``grid`` cells), one causal pass (fc, attention
    without input norm, post-attention norm, SwiGLU), the target's head on every state.
    hidden [rows, s, D], ids [s] -> logits [rows, s, V]."""
    rows, s, d = hidden.shape
    nh = DRAFTER["num_attention_heads"]
    hd = d // nh
    x = F.linear(torch.cat([w["embed_tokens.weight"][ids].expand(rows, -1, -1), hidden], dim=-1), w["fc.weight"], w.get("fc.bias"))
    rope = lantern_rope(hd, grid, 119)[:s]

    def rotate(t: torch.Tensor) -> torch.Tensor:
        t = t.view(rows, s, nh, hd // 2, 2)
        c, si = rope[None, :, None, :, 0], rope[None, :, None, :, 1]
        return torch.stack([t[..., 0] * c - t[..., 1] * si, t[..., 1] * c + t[..., 0] * si], dim=-1).flatten(3).transpose(1, 2)

    q, k = (rotate(F.linear(x, w[f"layers.0.self_attn.{p}_proj.weight"])) for p in "qk")
    v = F.linear(x, w["layers.0.self_attn.v_proj.weight"]).view(rows, s, nh, hd).transpose(1, 2)
    scores = q @ k.transpose(2, 3) / math.sqrt(hd) + torch.full((s, s), torch.finfo(torch.float32).min).triu(1)
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(rows, s, d)
    h = x + F.linear(att, w["layers.0.self_attn.o_proj.weight"])
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + DRAFTER["rms_norm_eps"]) * w["layers.0.post_attention_layernorm.weight"]
    h = h + F.linear(F.silu(F.linear(n, w["layers.0.mlp.gate_proj.weight"])) * F.linear(n, w["layers.0.mlp.up_proj.weight"]), w["layers.0.mlp.down_proj.weight"])
    return F.linear(h, head)


def lantern_first_logits(w: dict, hidden: torch.Tensor, t0: int, head: torch.Tensor) -> torch.Tensor:
    """LANTERN's first draft: pairs (state p, id p) for ids 0 x 119 then t0, the logits of
    the last.  hidden [rows, 120, D]."""
    ids = torch.tensor([0] * (hidden.shape[1] - 1) + [t0])
    return lantern_draft_logits(w, hidden, ids, head)[:, -1]


@pytest.fixture
def target(tmp_path):
    write_target(tmp_path / "LlamaGen-T2I")
    return load_target(tmp_path / "LlamaGen-T2I")


@pytest.mark.parametrize("bias, weights", [(True, "pytorch_model.bin"), (False, "model.safetensors")])
def test_first_logits_match_lanterns_drafter(tmp_path, target, bias, weights):
    tensors = write_drafter(tmp_path / "drafter", target, bias=bias, weights=weights)
    drafter = load_drafter(target, tmp_path / "drafter")
    assert isinstance(drafter, FolderDrafter) and drafter.layer_config.n_head == DRAFTER["num_attention_heads"]
    out = target.prefill(caption(7), cfg=True)
    drafter.prefill(caption(7), cfg=True)
    t0 = int(out.logits[0, -1].argmax())
    ours = drafter.start(out.hidden, torch.tensor([t0]))
    theirs = lantern_first_logits(tensors, target.condition_hidden(), t0, target.output.weight)
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("input_type, grid", [("t2i", 16), ("t2i2", 32)])
def test_logits_at_every_image_token_match_lanterns_drafter(tmp_path, target, input_type, grid):
    """Image token k is drafted at cell k of the drafter's own grid (slot 119 + k), not at
    the target's cell: the 4 x 4 target's tokens 4.. sit elsewhere in a 16 x 16 or 32 x 32 table."""
    tensors = write_drafter(tmp_path / "drafter", target, input_type=input_type)
    drafter = load_drafter(target, tmp_path / "drafter")
    tokens = torch.randint(0, target.vocab_size, (target.num_tokens,), generator=torch.Generator().manual_seed(3))
    out = target.prefill(caption(7), cfg=True)
    condition, states = target.condition_hidden(), [out.hidden]
    for t in tokens[:-1]:
        states.append(target.forward_tree(t[None], torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool)).hidden)
        target.commit(torch.tensor([0]))
    states = torch.cat(states, dim=1)
    drafter.prefill(caption(7), cfg=True)
    ours = torch.stack([drafter.start(states[:, k : k + 1], t[None]) for k, t in enumerate(tokens)], dim=1)
    hidden = torch.cat([condition[:, :-1], states], dim=1)
    ids = torch.cat([torch.zeros(119, dtype=torch.long), tokens])
    theirs = lantern_draft_logits(tensors, hidden, ids, target.output.weight, grid)[:, 119:]
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_greedy_naive_with_the_drafter_is_greedy_ar(tmp_path, target, mode):
    write_drafter(tmp_path / "drafter", target)
    drafter = load_drafter(target, tmp_path / "drafter")
    target.set_step_mode(mode)
    drafter.set_step_mode(mode)
    conditions = [caption(7), caption(1, seed=1), caption(120, seed=2)]
    ar, naive = (Engine(target, drafter, method, sampling=GREEDY).generate(conditions, seed=0).tokens for method in ("ar", "naive"))
    assert torch.equal(torch.as_tensor(ar), torch.as_tensor(naive))


def test_a_c2i_drafter_folder_drives_a_class_conditional_target(tmp_path):
    """input_type c2i: no caption pairs, image token k at grid cell k of a 24x24 table."""
    target = build_target("GPT-B", seed=0, dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=256, num_classes=10, block_size=16)
    write_drafter(tmp_path / "drafter", target, input_type="c2i")
    drafter = load_drafter(target, tmp_path / "drafter")
    assert drafter.context == 0 and drafter.draft_rope().shape[0] == 24 * 24
    ar, naive = (Engine(target, drafter, method, sampling=GREEDY).generate([1, 4], seed=0).tokens for method in ("ar", "naive"))
    assert torch.equal(torch.as_tensor(ar), torch.as_tensor(naive))


def test_fixed_shape_drafting_equals_eager_drafting(tmp_path, target):
    write_drafter(tmp_path / "drafter", target)
    drafter = load_drafter(target, tmp_path / "drafter")
    out = target.prefill(caption(7), cfg=True)
    drafts = []
    for mode in ("eager", "static"):
        drafter.set_step_mode(mode)
        drafter.prefill(caption(7), cfg=True)
        first = drafter.start(out.hidden, torch.tensor([3]))
        drafts.append((first, drafter.expand(torch.tensor([0, 0]), torch.tensor([5, 6])), drafter.expand(torch.tensor([1]), torch.tensor([7]))))
    for eager, static in zip(*drafts):
        torch.testing.assert_close(static, eager, atol=1e-5, rtol=0)


def test_what_does_not_fit_is_refused(tmp_path, target):
    write_drafter(tmp_path / "drafter", target)
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({**config, "input_type": None}))
    with pytest.raises(SpecimgError, match="names no LANTERN drafter RoPE"):
        load_drafter(target, tmp_path / "drafter")
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(SpecimgError, match="a drafter of width 32 and vocabulary 256, for a target of width 64"):
        load_drafter(target, tmp_path / "drafter")
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(config))
    other = write_target(tmp_path / "short", cls_token_num=8, block_size=16)
    with pytest.raises(SpecimgError, match="reads 120 condition positions; the target has 8"):
        load_drafter(other, tmp_path / "drafter")
    with pytest.raises(SpecimgError, match="not saved as a specimg drafter file"):
        save_drafter(load_drafter(target, tmp_path / "drafter"), tmp_path / "d.safetensors")


def test_generate_with_a_target_folder_and_a_drafter_folder(tmp_path, target, capsys):
    write_drafter(tmp_path / "drafter", target)
    save_tokenizer(build_tokenizer(seed=1, **TINY_VQ), tmp_path / "vq.safetensors")
    HashTextEncoder(dim=12).save(tmp_path / "enc.safetensors")
    files = ["--target", str(tmp_path / "LlamaGen-T2I"), "--tokenizer", str(tmp_path / "vq.safetensors"), "--text-encoder", str(tmp_path / "enc.safetensors")]
    args = ["generate", *files, "--drafter", str(tmp_path / "drafter"), "-m", "lantern", "--prompt", "a red cube", "-n", "2"]
    assert run(*args, "--out", str(tmp_path / "out")) == 0, capsys.readouterr().err
    assert len(list((tmp_path / "out" / "images").iterdir())) == 2
    capsys.readouterr()
    (tmp_path / "drafter" / "config.json").write_text("{}")
    assert "names no LANTERN drafter RoPE" in one_line_error(capsys, [*args, "--out", str(tmp_path / "out2")])
