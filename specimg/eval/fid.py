"""FID for real models, through torchmetrics' FrechetInceptionDistance, with a feature
extractor from a local file (the ``eval`` extra; nothing is downloaded): ``--fid-features``
names a TorchScript module mapping uint8 images [B, 3, S, S] to features [B, D] (clean-fid's
``inception-2015-12-05.pt`` works as is), or ``inception:PATH``, torch-fidelity's
Inception-v3 weights.  Images reach the extractor resized to S = ``image_size``.
"""

from __future__ import annotations

import os
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specimg.errors import SpecimgError
from specimg.eval.metrics import Frechet

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


class ScriptedFeatures(nn.Module):
    """A TorchScript feature extractor behind torchmetrics' custom-extractor interface:
    uint8 [B, 3, H, W] in, float [B, D] out."""

    def __init__(self, module: nn.Module, image_size: int) -> None:
        super().__init__()
        self.module, self.image_size = module, image_size
        schema = getattr(getattr(module, "forward", None), "schema", None)
        names = [a.name for a in schema.arguments] if schema is not None else []
        self.return_features = "return_features" in names

    def forward(self, images: Tensor) -> Tensor:
        x = images
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(x.float(), size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
            x = x.round().clamp(0, 255).to(torch.uint8)
        out = self.module(x, return_features=True) if self.return_features else self.module(x)
        return out.reshape(out.shape[0], -1).float()


def load_feature_extractor(spec: str, image_size: int = 299) -> nn.Module | tuple[int, str]:
    """``spec`` -> a module for ``FrechetInceptionDistance(feature=...)``, or (2048, weights
    path) for torch-fidelity's Inception with local weights."""
    if spec.startswith("inception:"):
        path = spec.partition(":")[2]
        if not os.path.isfile(path):
            raise SpecimgError(f"no Inception weights file at {path}")
        return 2048, path
    if not os.path.isfile(spec):
        raise SpecimgError(f"no feature extractor file at {spec}")
    try:
        module = torch.jit.load(spec, map_location="cpu").eval()
    except Exception as err:  # noqa: BLE001 - a file the user gave us that does not load
        raise SpecimgError(f"{spec} is not a TorchScript feature extractor: {err}") from None
    return ScriptedFeatures(module, image_size)


def to_uint8(images: Tensor) -> Tensor:
    """Images in [-1, 1] (specimg's convention) -> uint8 [0, 255]; uint8 images as they are."""
    return images if images.dtype == torch.uint8 else ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


class FID:
    """FID of several sample sets against one reference set, the reference's features
    computed once (``reset_real_features=False``)."""

    def __init__(self, features: nn.Module | tuple[int, str], real: Tensor, batch_size: int = 64) -> None:
        try:
            from torchmetrics.image.fid import FrechetInceptionDistance
        except ImportError:
            raise SpecimgError("FID needs torchmetrics: pip install 'specimg[eval]'") from None
        try:
            feature, weights = features if isinstance(features, tuple) else (features, None)
            self.metric = FrechetInceptionDistance(feature=feature, feature_extractor_weights_path=weights, reset_real_features=False)
        except (ModuleNotFoundError, ImportError) as err:
            raise SpecimgError(f"FID: {err}") from None
        self.batch_size = batch_size
        self.num_real = int(real.shape[0])
        if self.num_real < 2:
            raise SpecimgError(f"FID needs at least 2 reference images, got {self.num_real}")
        with torch.no_grad():
            for s in range(0, real.shape[0], batch_size):
                self.metric.update(to_uint8(real[s : s + batch_size]), real=True)

    @torch.no_grad()
    def __call__(self, images: Tensor) -> Frechet:
        """FID of ``images`` ([-1, 1] floats or uint8) against the reference set."""
        if images.shape[0] < 2:
            raise SpecimgError(f"FID needs at least 2 samples, got {images.shape[0]}")
        self.metric.reset()
        for s in range(0, images.shape[0], self.batch_size):
            self.metric.update(to_uint8(images[s : s + self.batch_size]), real=False)
        return Frechet(float(self.metric.compute()), int(images.shape[0]), self.num_real)


def read_image_folder(path: str | os.PathLike[str], size: int, limit: int | None = None) -> Tensor:
    """Reference images: the image files of a folder (sorted by name, at most ``limit``),
    centre-cropped to a square and resized to ``size``; uint8 [N, 3, size, size]."""
    from PIL import Image

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise SpecimgError(f"--real-images {path} is not a folder")
    names = sorted(n for n in os.listdir(path) if n.lower().endswith(IMAGE_SUFFIXES))[:limit]
    if not names:
        raise SpecimgError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {path}")
    out = []
    for name in names:
        try:
            with Image.open(os.path.join(path, name)) as im:
                im = im.convert("RGB")
                side = min(im.size)
                left, top = (im.size[0] - side) // 2, (im.size[1] - side) // 2
                im = im.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.BICUBIC)
                out.append(torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(size, size, 3).permute(2, 0, 1))
        except OSError as err:
            raise SpecimgError(f"cannot read image {os.path.join(path, name)}: {err}") from None
    return torch.stack(out)
