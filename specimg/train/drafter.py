"""EAGLE drafter training with accelerate: one CPU, one GPU or many processes, same code.

Loss (EAGLE-1, ``eagle/train/main.py``), per position [B, T]:

    loss[b, t] = w_cls * soft_CE(p_target, q_drafter) + w_reg * mean_D SmoothL1(pred_feature, target_feature)

with EAGLE's weights ``w_cls = 0.1`` (``p_w``) and ``w_reg = 1.0`` (``v_w``).  Position t
is the drafter's pair t = (the target's feature before token t, token t), t < N - 1: it
regresses the target's state after consuming token t, ``F_t``, and matches the target's
distribution for token t + 1, ``softmax(output(F_t))`` (the frozen shared head, so the
distribution is recomputed exactly from the stored features).  Before the two parts are
summed, the ``train_loss`` hooks of the method stack reweight them, in method-string
order, each with its own options (``--method cascade`` boosts the cross-entropy at
convergent positions; what they receive: docs/hooks.md).  Finally the masked mean over
the *global* batch.

EAGLE-3 (``drafter_type="eagle3"``, :func:`loss_terms`) drops the regression and trains
with training-time test: K = ``ttt_steps`` unrolled steps, step i feeding the drafter its
own output states of step i - 1, and

    loss[b, t] = sum_i 0.8^i * w_cls * soft_CE_i(p_target, q_drafter)[b, t]

(EAGLE-3's decay: a deeper step's error matters less, as its node is reached less often).
The hooks get the parts per step, [K, B, T] (regression zero).  The masked mean divides by
the step-0 positions, so the steps' weights stay 0.8^i.

``batch_size`` is the global batch: each of P processes takes its own B / P examples of
the same global batch, the local loss is scaled so that DDP's gradient average is the
gradient of the global masked mean, and data order depends only on (seed, step) — so a
run gives the same drafter on 1 or P processes (up to reduction order), and a resumed run
continues exactly where the checkpoint stood.

Output folder::

    run.json                    the run's settings; a folder is never reused for other settings
    state.json                  {step, epoch, checkpoint, done}: written last, the commit point
    checkpoints/step-000500/    accelerator.save_state (drafter, optimizer, RNG states)
    log.jsonl                   one line per logged step: loss, ce, kl, reg, acc, lr, grad_norm, seconds
                                (EAGLE-3: ce, kl and acc of step 0, and acc1, acc2, ... of the later steps)
    drafter.safetensors         the final drafter (save_drafter)

A run started again on a folder with a state resumes from its last checkpoint; log lines
after that checkpoint are dropped and made again, so nothing is lost or duplicated.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from attrs import validators as v
from torch import Tensor, nn

from specimg.errors import SpecimgError
from specimg.files import atomic_path
from specimg.models.eagle import DRAFTER_TYPES, EagleTarget, TreeDrafter, build_drafter, save_drafter
from specimg.models.loading import load_drafter
from specimg.plugins import PluginManager, get_plugin_manager
from specimg.progress import progress_bar
from specimg.stackhooks import MemberHook, StackHooks
from specimg.train.data import DrafterData, _atomic_write_json, _read_json
from specimg.train.schedule import WarmupCosine

TTT_DECAY = 0.8
"""EAGLE-3's weight ratio between consecutive unrolled steps."""
RUN, STATE, LOG, FINAL = "run.json", "state.json", "log.jsonl", "drafter.safetensors"


@attrs.frozen
class TrainConfig:
    """Hyper-parameters.  Defaults are the published ones of the drafter type (EAGLE-1's or
    EAGLE-3's) where it has one; EAGLE decays linearly, here warmup + cosine."""

    drafter_type: str = attrs.field(default="eagle1", validator=v.in_(DRAFTER_TYPES))
    ttt_steps: int = attrs.field(default=7, validator=[v.ge(1), v.le(16)])
    """EAGLE-3's unrolled training-time-test steps (ignored by EAGLE-1)."""
    steps: int = attrs.field(default=1000, validator=v.ge(1))
    batch_size: int = attrs.field(default=8, validator=v.ge(1))
    """Global batch (all processes together), in examples (images)."""
    lr: float = attrs.field(default=attrs.Factory(lambda c: 5e-5 if c.drafter_type == "eagle3" else 3e-5, takes_self=True), validator=v.gt(0.0))
    weight_decay: float = attrs.field(default=0.0, validator=v.ge(0.0))
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int | None = None
    """Linear warmup; None: 5% of the steps."""
    min_lr_ratio: float = attrs.field(default=0.0, validator=[v.ge(0.0), v.le(1.0)])
    """The cosine decays to lr * min_lr_ratio at the last step."""
    w_cls: float = attrs.field(default=attrs.Factory(lambda c: 1.0 if c.drafter_type == "eagle3" else 0.1, takes_self=True), validator=v.ge(0.0))
    """EAGLE-1's p_w 0.1 (against the regression's 1.0); EAGLE-3, which has no regression: 1.0."""
    w_reg: float = attrs.field(default=1.0, validator=v.ge(0.0))
    clip_value: float | None = attrs.Factory(lambda c: None if c.drafter_type == "eagle3" else 0.5, takes_self=True)
    """Clip each gradient element to [-clip_value, clip_value] (EAGLE-1); None: off."""
    clip_norm: float | None = attrs.Factory(lambda c: 0.5 if c.drafter_type == "eagle3" else None, takes_self=True)
    """Clip the global gradient norm (EAGLE-3); None: off."""
    noise: float = attrs.field(default=0.0, validator=v.ge(0.0))
    """Uniform noise of this width added to the input features (EAGLE's data noise; EAGLE
    uses 0.2 * 512 / length for LLM features)."""
    checkpoint_every: int = attrs.field(default=500, validator=v.ge(1))
    keep_checkpoints: int = attrs.field(default=2, validator=v.ge(1))
    log_every: int = attrs.field(default=10, validator=v.ge(1))
    seed: int = 0
    mixed_precision: str = attrs.field(default="no", validator=v.in_(("no", "fp16", "bf16")))

    @property
    def warmup(self) -> int:
        return self.steps // 20 if self.warmup_steps is None else self.warmup_steps


@attrs.frozen
class StepInfo:
    """What ``on_step`` gets after each optimizer step (``step`` = steps done)."""

    step: int
    epoch: int
    indices: tuple[int, ...]
    """This process's examples in the step's batch."""
    metrics: dict[str, float]


@attrs.frozen(eq=False)
class TrainResult:
    drafter: TreeDrafter
    steps: int
    path: str
    """The final drafter file."""


# ----------------------------------------------------------------------------- loss


def loss_terms(
    drafter: Callable[..., Any],
    head: Callable[[Tensor], Tensor],
    inputs: Tensor,
    features: Tensor,
    tokens: Tensor,
    steps: int | None = None,
    noise: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-position terms for whole images: the drafter's ``inputs`` [B, N, ...] (EAGLE-1:
    the ``features``; EAGLE-3: the target's fused layers [B, N, kD]) and ``features`` [B, N, D]
    (the target's distributions) as ``forward_sequence`` returns them, ``tokens`` [B, N].
    With ``steps`` (EAGLE-3's unrolled steps K): ``ce`` (the soft cross-entropy), ``kl`` (ce
    minus the target's entropy), ``reg`` (zero), ``correct`` (drafter argmax == target argmax)
    and ``mask`` [K, B, N - 1], and what the hooks read, ``target`` [K, B, N - 1, D] and
    ``tokens`` [K, B, N - 1]: entry t of step i consumes token t + i and matches the target's
    distribution for token t + i + 1, ``softmax(head(features[:, t + i + 1]))``.  Without
    (EAGLE-1): the entries of its one step, [B, N - 1], with ``reg`` the regression of the
    features ``target``.  The loss, ``w_cls * ce + w_reg * reg``, is summed after the
    ``train_loss`` hooks (:func:`apply_loss_hooks`)."""
    consumed, after = tokens[:, :-1], features[:, 1:]
    x = inputs[:, :-1] if noise is None else inputs[:, :-1] + noise
    out = drafter(x, consumed) if steps is None else drafter(x, consumed, steps)
    t = consumed.shape[1]
    with torch.no_grad():
        target_logits = head(after).float()
        log_p = target_logits.log_softmax(dim=-1)
        p = log_p.exp()
        entropy = -(p * log_p).sum(dim=-1)
        best = target_logits.argmax(dim=-1)
    terms: dict[str, list[Tensor]] = {k: [] for k in ("ce", "kl", "correct", "mask", "target", "tokens")}
    for i, logits in enumerate([out[1]] if steps is None else out):
        logits = logits[:, : t - i].float()  # entries with a token to consume
        ce = -(p[:, i:] * logits.log_softmax(dim=-1)).sum(dim=-1)
        for key, value in (
            ("ce", ce), ("kl", ce.detach() - entropy[:, i:]), ("correct", (logits.argmax(dim=-1) == best[:, i:]).float()),
            ("mask", torch.ones_like(ce, dtype=torch.bool)), ("target", after[:, i:]), ("tokens", consumed[:, i:]),
        ):
            terms[key].append(torch.cat([value, value.new_zeros(value.shape[0], min(i, t), *value.shape[2:])], dim=1))
    stacked = {k: torch.stack(v) for k, v in terms.items()}
    if steps is not None:
        return stacked | {"reg": torch.zeros_like(stacked["ce"])}
    return {k: v[0] for k, v in stacked.items()} | {"reg": F.smooth_l1_loss(out[0].float(), after.float(), reduction="none").mean(dim=-1)}


def ttt_fold(loss: Tensor, mask: Tensor) -> Tensor:
    """EAGLE-3's per-position loss [B, T] from its steps' [K, B, T]: sum_i 0.8^i loss_i over
    the valid entries."""
    decay = TTT_DECAY ** torch.arange(loss.shape[0], device=loss.device, dtype=loss.dtype)
    return (loss * mask * decay[:, None, None]).sum(dim=0)


def loss_hooks(plugins: PluginManager, method: str | None, options: Mapping[str, Mapping[str, Any]] | None) -> tuple[tuple[MemberHook, ...], dict[str, Any]]:
    """The ``train_loss`` hooks of the stack's members that implement it, in method-string
    order; and the stack's options (for the run record)."""
    if not method:
        if options:
            raise SpecimgError("method options (-o) given without --method")
        return (), {}
    stack = plugins.stack(method, options)
    return StackHooks.bind(plugins, stack).train_losses, {"method": stack.name, "options": stack.options_dict()}


def apply_loss_hooks(
    hooks: Sequence[MemberHook], soft_ce: Tensor, regression: Tensor, w_cls: float, w_reg: float, features: Tensor, tokens: Tensor, mask: Tensor
) -> Tensor:
    """Fold the loss's parts [B, T] through the hooks in order, then weigh and sum them into
    the per-position loss."""
    parts = (soft_ce, regression)
    for hook in hooks:
        new = hook(soft_ce=parts[0], regression=parts[1], w_cls=w_cls, w_reg=w_reg, features=features, tokens=tokens, mask=mask)
        if new is None:
            continue
        if not (isinstance(new, tuple) and len(new) == 2 and all(isinstance(t, Tensor) and t.shape == soft_ce.shape for t in new)):
            got = f"a tensor of shape {tuple(new.shape)}" if isinstance(new, Tensor) else type(new).__name__
            raise SpecimgError(f"method {hook.method!r}: train_loss returned {got}, expected the parts (soft_ce, regression), each {tuple(soft_ce.shape)}")
        parts = new
    return w_cls * parts[0] + w_reg * parts[1]


class _Trainable(nn.Module):
    """Routes ``forward`` to the drafter's teacher-forced pass, so DDP syncs its gradients."""

    def __init__(self, drafter: TreeDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, *args: Any) -> Any:
        return self.drafter.forward_train(*args)


# ----------------------------------------------------------------------------- run folder


def _truncate_log(path: str, step: int) -> None:
    """Keep the log lines of steps before ``step`` (a cut last line is dropped too)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                if json.loads(line)["step"] < step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (json.JSONDecodeError, KeyError, TypeError):
                break
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(kept)


def _prune(out: str, keep: int) -> None:
    ckpts = os.path.join(out, "checkpoints")
    if not os.path.isdir(ckpts):
        return
    names = sorted(n for n in os.listdir(ckpts) if n.startswith("step-") and ".tmp" not in n)
    for name in names[:-keep]:
        shutil.rmtree(os.path.join(ckpts, name), ignore_errors=True)
    for name in os.listdir(ckpts):
        if ".tmp" in name:  # a checkpoint cut by a kill
            shutil.rmtree(os.path.join(ckpts, name), ignore_errors=True)


# ----------------------------------------------------------------------------- training


def train_drafter(
    target: EagleTarget,
    data: DrafterData | str | os.PathLike[str],
    out: str | os.PathLike[str],
    config: TrainConfig = TrainConfig(),
    *,
    method: str | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    plugins: PluginManager | None = None,
    init: str | os.PathLike[str] | None = None,
    accelerator: Any = None,
    on_step: Callable[[StepInfo], None] | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train an EAGLE drafter of ``config.drafter_type`` for ``target`` on a data folder
    (EAGLE-3 needs data made for it); resume if ``out`` holds a state of the same run.
    ``init`` starts from a drafter file of that type.  The target is moved to the
    accelerator's device in float32 and stays frozen.  Call it in every process
    (``accelerate launch`` or ``accelerate.debug_launcher``); each returns the drafter,
    identical in all of them.  ``on_step`` is called after every optimizer step."""
    from accelerate import Accelerator

    hooks, stack_record = loss_hooks(plugins or get_plugin_manager(), method, options)
    data = data if isinstance(data, DrafterData) else DrafterData(data)
    data.check_target(target)
    if config.drafter_type == "eagle3" and data.drafter_type != "eagle3":
        raise SpecimgError(
            f"{data.path} holds EAGLE-1 data (the target's last hidden states); an EAGLE-3 drafter reads three of its layers: "
            "make its data with `specimg make-drafter-data --drafter-type eagle3`"
        )
    if data.num_tokens < 2:
        raise SpecimgError("drafter training needs images of at least 2 tokens")
    accelerator = accelerator or Accelerator(mixed_precision=config.mixed_precision)
    if config.batch_size % accelerator.num_processes:
        raise SpecimgError(f"--batch-size {config.batch_size} (the global batch) is not a multiple of the {accelerator.num_processes} processes")
    if len(data) < config.batch_size:
        raise SpecimgError(f"the data holds {len(data)} examples, fewer than one batch of {config.batch_size}")
    out = os.fspath(out)
    kept = attrs.asdict(config, filter=lambda a, _: a.name != "ttt_steps" or config.drafter_type == "eagle3")  # EAGLE-1 runs resume as before
    settings = {
        "config": kept, **stack_record, "data": data.meta["settings"], "target": data.meta["target"],
        "init": os.path.abspath(init) if init else None, "processes": accelerator.num_processes,
    }
    state = _open_run(out, settings, config.keep_checkpoints, accelerator)
    step = int(state["step"]) if state is not None else 0
    training = _Training.build(target, init, config, hooks, accelerator, data.feature_layers, step)
    if state is not None:  # restore the checkpoint the state points to
        ckpt = os.path.join(out, state["checkpoint"])
        if not os.path.isdir(ckpt):
            raise SpecimgError(f"{os.path.join(out, STATE)} points to {ckpt}, which is missing")
        accelerator.load_state(ckpt)
    if state is not None and state.get("done") and os.path.exists(os.path.join(out, FINAL)):
        return TrainResult(training.drafter().eval(), step, os.path.join(out, FINAL))
    bar = progress_bar(total=config.steps, initial=step, unit="step", desc="train-drafter", show=accelerator.is_main_process and progress)
    tick, order, local = time.perf_counter(), None, config.batch_size // accelerator.num_processes
    while step < config.steps:
        # the global batch depends only on (seed, step); each process takes its own slice of it
        epoch, b = divmod(step, len(data) // config.batch_size)
        if order is None or b == 0:  # the epoch's order, drawn once for all of its steps
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(config.seed * 1_000_003 + epoch))
        first = b * config.batch_size + accelerator.process_index * local
        indices = order[first : first + local].tolist()
        batch = data.get(indices)
        metrics = training.step(batch, _noise(config, step, indices, batch["layers" if "layers" in batch else "features"].shape[1:]))
        step += 1
        now = time.perf_counter()
        metrics["seconds"], tick = now - tick, now
        if accelerator.is_main_process:
            if (step - 1) % config.log_every == 0 or step == config.steps:
                with open(os.path.join(out, LOG), "a", encoding="utf-8") as fh:
                    fh.write(json.dumps({"step": step - 1, "epoch": epoch, **metrics}) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", acc=f"{metrics['acc']:.3f}")
        if step % config.checkpoint_every == 0 or step == config.steps:
            _checkpoint(accelerator, out, step, epoch, done=step == config.steps, keep=config.keep_checkpoints)
        if on_step:
            on_step(StepInfo(step, epoch, tuple(indices), metrics))
    bar.close()
    final = training.drafter().eval()
    path = os.path.join(out, FINAL)
    if accelerator.is_main_process:
        save_drafter(final, path)
    accelerator.wait_for_everyone()
    return TrainResult(final, step, path)


def _open_run(out: str, settings: dict[str, Any], keep: int, accelerator: Any) -> dict[str, Any] | None:
    """Refuse a folder that holds another run; prepare it (settings recorded, log lines and
    checkpoints past the last state dropped); return its state, None for a fresh run."""
    settings = json.loads(json.dumps(settings))  # tuples -> lists, as they come back from disk
    run_path, state_path = os.path.join(out, RUN), os.path.join(out, STATE)
    old = _read_json(run_path)
    state = _read_json(state_path)
    if old is not None and old != settings:
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff == ["config"]:
            diff = [f"--{k.replace('_', '-')}" for k in sorted(settings["config"]) if old["config"].get(k) != settings["config"][k]]
        raise SpecimgError(f"{out} holds a training run with other settings (differs in {', '.join(diff)}); use another --out")
    accelerator.wait_for_everyone()  # everyone has read the folder before it changes
    if accelerator.is_main_process:
        if old is None:
            _atomic_write_json(run_path, settings)
        _truncate_log(os.path.join(out, LOG), state["step"] if state else 0)
        _prune(out, keep)
    return state


def _noise(config: TrainConfig, step: int, indices: list[int], shape: torch.Size) -> Tensor | None:
    """EAGLE's uniform input noise [b, N - 1, D] for examples of ``shape`` [N, D], per
    example and step: the same whatever the number of processes."""
    if config.noise <= 0:
        return None
    seeds = [hashlib.sha256(f"{config.seed}/{step}/{i}".encode()).digest() for i in indices]
    noise = torch.stack([torch.rand(shape, generator=torch.Generator().manual_seed(int.from_bytes(seed[:7], "little"))) for seed in seeds])
    return (noise[:, :-1] - 0.5) * config.noise


@attrs.define(eq=False)
class _Training:
    """The drafter under training and what one optimizer step needs: the frozen target's
    head, the optimizer and its schedule, the stack's loss hooks."""

    accelerator: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[Tensor]
    head: Callable[[Tensor], Tensor]
    hooks: Sequence[MemberHook]
    config: TrainConfig
    schedule: WarmupCosine

    @classmethod
    def build(
        cls, target: EagleTarget, init: str | os.PathLike[str] | None, config: TrainConfig, hooks: Sequence[MemberHook], accelerator: Any,
        feature_layers: Sequence[int], step: int,
    ) -> _Training:
        """The learning-rate schedule starts at optimizer step ``step`` (a resumed run's)."""
        # frozen (build_drafter turns its gradients off); the drafter shares its embeddings (EAGLE-1: and head),
        # and trains in float32 (mixed precision comes from the accelerator's autocast)
        target.to(device=accelerator.device, dtype=torch.float32).eval()
        settings = {"feature_layers": tuple(feature_layers)} if config.drafter_type == "eagle3" else {}
        drafter = load_drafter(target, init) if init else build_drafter(target, seed=config.seed, kind=config.drafter_type, **settings)
        if drafter.kind != config.drafter_type or drafter.settings() != {k: list(v) for k, v in settings.items()}:
            raise SpecimgError(f"--init {init} holds an {drafter.kind} drafter {drafter.settings() or ''}, not the {config.drafter_type} drafter of this data {settings or ''}")
        drafter.float().train()
        if any(p.requires_grad for p in target.parameters()):
            raise AssertionError("the target must be frozen")
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        model, optimizer = accelerator.prepare(_Trainable(drafter), optimizer)
        params = [p for p in drafter.parameters() if p.requires_grad]
        schedule = WarmupCosine(optimizer, config.lr, config.steps, config.warmup, config.min_lr_ratio, start=step)
        return cls(accelerator, model, optimizer, params, target.code_logits, hooks, config, schedule)

    def drafter(self) -> TreeDrafter:
        return self.accelerator.unwrap_model(self.model).drafter

    def step(self, batch: dict[str, Tensor], noise: Tensor | None) -> dict[str, float]:
        """One optimizer step on this process's share of the global batch; the metrics of
        the whole batch (losses, top-1 agreement, learning rate, gradient norm)."""
        accelerator, config = self.accelerator, self.config
        device = accelerator.device
        features, tokens = batch["features"].to(device), batch["tokens"].to(device)
        noise = None if noise is None else noise.to(device)
        lr = self.schedule.get_last_lr()[0]
        eagle3 = config.drafter_type == "eagle3"
        with accelerator.autocast():
            inputs = batch["layers"].to(device) if eagle3 else features
            terms = loss_terms(self.model, self.head, inputs, features, tokens, config.ttt_steps if eagle3 else None, noise)
        loss = apply_loss_hooks(self.hooks, terms["ce"], terms["reg"], config.w_cls, config.w_reg, terms["target"], terms["tokens"], terms["mask"])
        m = terms["mask"].float()
        step_acc = []
        if eagle3:  # top-1 agreement per unrolled step, over its own positions; the rest over the positions of step 0
            hits = accelerator.reduce(torch.stack([(terms["correct"] * m).sum(dim=(1, 2)), m.sum(dim=(1, 2))]), "sum")
            step_acc = (hits[0] / hits[1].clamp(min=1)).tolist()
            loss, m = ttt_fold(loss, m), m[0]
            terms = {k: v[0] for k, v in terms.items()}
        count = accelerator.reduce(m.sum().detach().reshape(1), "sum").clamp(min=1)
        # scaled so that DDP's gradient average is the gradient of the global masked mean
        accelerator.backward((loss * m).sum() * accelerator.num_processes / count[0])
        accelerator.unscale_gradients()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, config.clip_norm if config.clip_norm else float("inf"))
        if config.clip_value is not None:
            torch.nn.utils.clip_grad_value_(self.params, config.clip_value)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.stack([(loss * m).sum(), *((terms[k] * m).sum() for k in ("ce", "kl", "reg", "correct"))]).detach()
        sums = accelerator.reduce(sums, "sum") / count
        return {
            "loss": float(sums[0]), "ce": float(sums[1]), "kl": float(sums[2]), "reg": float(sums[3]), "acc": float(sums[4]),
            **{f"acc{i}": float(a) for i, a in enumerate(step_acc) if i > 0}, "lr": lr, "grad_norm": float(grad_norm),
        }


def _checkpoint(accelerator: Any, out: str, step: int, epoch: int, done: bool, keep: int) -> None:
    """Save to a temporary folder, rename it, then point state.json at it: a kill at any
    moment leaves the previous checkpoint intact and referenced."""
    name = f"step-{step:06d}"
    final = os.path.join(out, "checkpoints", name)
    tmp = f"{final}.tmp"
    if accelerator.is_main_process and os.path.exists(tmp):
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_json(
            os.path.join(out, STATE),
            {"step": step, "epoch": epoch, "checkpoint": os.path.join("checkpoints", name), "done": done},
        )
        _prune(out, keep)
    accelerator.wait_for_everyone()
