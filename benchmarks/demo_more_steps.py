"""Does the demo draw the asked digit more often with more target training?

    python benchmarks/demo_more_steps.py --steps 2000 --every 500 --lr 1e-3
    python benchmarks/demo_more_steps.py --steps 20000 --every 2000 --device cuda --out longer.safetensors

Continues the shipped demo target's training on the recipe's own training tokens (16 000
images of the near-duplicate scale, batch 16, AdamW with the recipe's betas and weight
decay, class dropout 0.1, warm-up and cosine from ``--lr``) and, before and every
``--every`` steps, measures what the recipe's quality stage measures: the classifier's
accuracy on AR samples at the demo's default sampling (``--per-class``, the same seeds
each time, so the figures are paired), with the held-out class gain and the target's accuracy
as a classifier.  One JSON line per measurement.  ``--out`` keeps the last target (its
drafters would need training again: `specimg train-demo` stages).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from specimg.demo import recipe
from specimg.demo.data import NUM_CLASSES, make_dataset
from specimg.engine import ar_tokens
from specimg.eval.classifier import load_classifier
from specimg.models.demo import bundle_dir, demo_sampling, load_target_file, save_target
from specimg.models.vq import load_tokenizer
from specimg.train.schedule import WarmupCosine

SEED_BASE, BATCH = 30_000, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--images", type=int, default=recipe.NEAR_DUPLICATE.target.images, help="training images (the recipe's by default)")
    parser.add_argument("--per-class", type=int, default=20, help="AR samples per class at each measurement")
    parser.add_argument("--out", help="write the continued target here (safetensors)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scale, root, device = recipe.NEAR_DUPLICATE, bundle_dir(), torch.device(args.device)
    target = load_target_file(f"{root}/target.safetensors").to(device)
    tokenizer = load_tokenizer(f"{root}/tokenizer.safetensors")
    classifier = load_classifier(f"{root}/classifier.safetensors")
    images, labels = make_dataset(args.images, seed=scale.seed + 3)
    codes = recipe.encode_images(tokenizer, images).to(device)
    labels = labels.to(device)
    test, test_labels = make_dataset(256, seed=scale.seed + 2, split="test")
    test_codes = recipe.encode_images(tokenizer, test).to(device)
    test_labels = test_labels.to(device)
    null = scale.target.config["num_classes"]
    wanted = [c for c in range(NUM_CLASSES) for _ in range(args.per_class)]

    def measure(step: int, extra: dict) -> None:
        target.eval().requires_grad_(False)
        with torch.no_grad():
            tokens = ar_tokens(target, wanted, [SEED_BASE + i for i in range(len(wanted))], demo_sampling()).cpu()
            drawn = torch.cat([tokenizer.decode(tokens[i : i + 64]) for i in range(0, len(wanted), 64)]).clamp(-1, 1)
        accuracy = (classifier.predict(drawn) == torch.tensor(wanted)).float().mean().item()
        held_out = recipe.held_out_metrics(target, test_labels, test_codes, null, classify=True)
        print(json.dumps({"step": step, **extra, "ar_accuracy": round(accuracy, 4), **held_out}), flush=True)
        target.train().requires_grad_(True)

    measure(0, {})
    decay = [p for n, p in target.named_parameters() if p.dim() >= 2 and "embedding" not in n]
    other = [p for n, p in target.named_parameters() if not (p.dim() >= 2 and "embedding" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": other, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    schedule = WarmupCosine(optimizer, args.lr, args.steps, max(1, args.steps // 20))
    generator = torch.Generator().manual_seed(scale.seed + 99)
    order, at, training = torch.randperm(codes.shape[0], generator=generator), 0, 0.0
    for step in range(args.steps):
        start = time.perf_counter()
        if at + BATCH > order.numel():
            order, at = torch.randperm(codes.shape[0], generator=generator), 0
        batch = order[at : at + BATCH]
        at += BATCH
        condition = labels[batch].clone()
        condition[(torch.rand(BATCH, generator=generator) < scale.target.config["class_dropout_prob"]).to(device)] = null
        loss = F.cross_entropy(target.forward_sequence(condition, codes[batch]).logits.flatten(0, 1).float(), codes[batch].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        training += time.perf_counter() - start
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            measure(step + 1, {"training_seconds": round(training), "loss": round(loss.item(), 3)})
    if args.out:
        save_target(target.eval(), args.out)


if __name__ == "__main__":
    main()
