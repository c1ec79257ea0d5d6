"""Image operations for AugMix and RandAugment, on tensors: each takes an image and a severity and draws its strength.

An image is a float tensor ``(C, H, W)`` with values in ``[0, 1]`` (C is 1 or 3). Every operation is
``op(image, severity, generator) -> image``: ``severity`` (0 to 10) bounds how strong it may be, the actual
strength is drawn from ``generator`` (torch's global generator when None), as in the AugMix paper and
Composer's ``augmentation_primitives``. Geometric operations fill uncovered pixels with black and sample
bilinearly; the colour operations follow PIL's ``ImageOps``/``ImageEnhance`` on 8-bit levels.

The sets, by name (Composer's): ``"safe"`` has the operations that do not overlap the corruptions of
ImageNet-C (autocontrast, equalize, posterize, rotate, solarize, shear and translate in x and y); ``"all"``
adds color, contrast, brightness and sharpness, whose factor is drawn on either side of 1 (weaker or stronger
by up to the severity); ``"original"`` adds those four as the AugMix reference code drew them
(factor ``0.1 + 0.18 * u``, ``u`` uniform in ``[0.1, severity)``, which mostly weakens).

Also here: :func:`as_float_image` (the accepted image types) and :func:`add_dataset_transform`, with which the
AugMix and RandAugment algorithms put their transform after the train dataset's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fabric.trainer.core.state import State

#: ``op(image, severity, generator) -> image``.
Augmentation = Callable[[torch.Tensor, float, torch.Generator | None], torch.Tensor]

AUGMENTATION_SET_NAMES = ("all", "safe", "original")


def _uniform(low: float, high: float, generator: torch.Generator | None) -> float:
    return low + (high - low) * float(torch.rand((), generator=generator, dtype=torch.float64))


def _sample_level(severity: float, generator: torch.Generator | None) -> float:
    """A strength in ``[0.1, severity)`` (0.1 when the severity is below it)."""
    return _uniform(0.1, max(severity, 0.1), generator)


def _random_sign(value: float, generator: torch.Generator | None) -> float:
    return -value if _uniform(0.0, 1.0, generator) > 0.5 else value


def _levels(image: torch.Tensor) -> torch.Tensor:
    """The image as integer levels 0..255."""
    return (image * 255).round().clamp(0, 255).long()


def _grayscale(image: torch.Tensor) -> torch.Tensor:
    """``(1, H, W)`` luminance (ITU-R 601-2, as PIL's "L" mode); a one-channel image is its own."""
    if image.shape[0] == 1:
        return image
    weights = torch.tensor([0.299, 0.587, 0.114], dtype=image.dtype, device=image.device)
    return (image * weights.view(3, 1, 1)).sum(0, keepdim=True)


def _blend(degenerate: torch.Tensor, image: torch.Tensor, factor: float) -> torch.Tensor:
    """PIL's ``ImageEnhance``: ``degenerate + factor * (image - degenerate)``, clipped to ``[0, 1]``."""
    return (degenerate + factor * (image - degenerate)).clamp(0, 1)


def _affine(image: torch.Tensor, matrix: Sequence[float]) -> torch.Tensor:
    """``image`` resampled at ``(a x + b y + c, d x + e y + f)`` for every output pixel centre ``(x, y)``.

    Coordinates are in pixels from the top-left corner (PIL's ``Image.transform(AFFINE)``); pixels that map
    outside the image become black.
    """
    a, b, c, d, e, f = matrix
    _, height, width = image.shape
    ys = torch.arange(height, dtype=image.dtype, device=image.device) + 0.5
    xs = torch.arange(width, dtype=image.dtype, device=image.device) + 0.5
    y, x = torch.meshgrid(ys, xs, indexing="ij")
    source_x, source_y = a * x + b * y + c, d * x + e * y + f
    grid = torch.stack((source_x * 2 / width - 1, source_y * 2 / height - 1), dim=-1)
    return F.grid_sample(image[None], grid[None], mode="bilinear", padding_mode="zeros", align_corners=False)[0]


def autocontrast(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Stretch each channel to span ``[0, 1]`` (no strength to draw)."""
    low = image.amin(dim=(1, 2), keepdim=True)
    high = image.amax(dim=(1, 2), keepdim=True)
    span = high - low
    return torch.where(span > 0, (image - low) / span.clamp_min(1e-12), image)


def equalize(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Equalize each channel's histogram of 256 levels (PIL's ``ImageOps.equalize``; no strength to draw)."""
    levels = _levels(image)
    channels = []
    for channel in levels:
        histogram = torch.bincount(channel.flatten(), minlength=256)
        used = histogram[histogram > 0]
        step = int(histogram.sum() - used[-1]) // 255
        if step == 0:
            channels.append(channel)
            continue
        before = torch.cumsum(histogram, 0) - histogram  # pixels below each level
        lut = ((before + step // 2) // step).clamp(max=255)
        channels.append(lut[channel])
    return torch.stack(channels).to(image.dtype) / 255


def posterize(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Keep the ``4 - int(0.4 * level)`` highest bits of each 8-bit level (4 to 1 bits)."""
    return posterize_to(image, 4 - int(_sample_level(severity, generator) * 4 / 10))


def posterize_to(image: torch.Tensor, bits: int) -> torch.Tensor:
    """PIL's ``ImageOps.posterize``: keep the ``bits`` highest bits of each 8-bit level."""
    kept: torch.Tensor = _levels(image) & (256 - 2 ** (8 - bits))
    return kept.to(image.dtype) / 255


def solarize(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Invert the levels at or above ``256 - int(25.6 * level)``."""
    return solarize_at(image, 256 - int(_sample_level(severity, generator) * 256 / 10))


def solarize_at(image: torch.Tensor, threshold: int) -> torch.Tensor:
    """PIL's ``ImageOps.solarize``: invert the 8-bit levels at or above ``threshold``."""
    levels = _levels(image)
    return torch.where(levels >= threshold, 255 - levels, levels).to(image.dtype) / 255


def rotate(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Rotate about the centre by ``int(3 * level)`` degrees, either way."""
    return rotate_by(image, _random_sign(int(_sample_level(severity, generator) * 30 / 10), generator))


def rotate_by(image: torch.Tensor, degrees: float) -> torch.Tensor:
    """``image`` rotated counter-clockwise by ``degrees`` about its centre (PIL's ``Image.rotate``)."""
    _, height, width = image.shape
    angle = math.radians(degrees)
    cos, sin = math.cos(angle), math.sin(angle)
    centre_x, centre_y = width / 2, height / 2
    # output pixel -> input pixel, about the centre: PIL's ``Image.rotate`` (counter-clockwise on screen)
    offset_x = centre_x - (cos * centre_x - sin * centre_y)
    offset_y = centre_y - (sin * centre_x + cos * centre_y)
    matrix = (cos, -sin, offset_x, sin, cos, offset_y)
    return _affine(image, matrix)


def shear_x(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Shear horizontally by a factor of ``0.03 * level``, either way."""
    return shear_by(image, _random_sign(_sample_level(severity, generator) * 0.3 / 10, generator), 0)


def shear_y(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Shear vertically by a factor of ``0.03 * level``, either way."""
    return shear_by(image, _random_sign(_sample_level(severity, generator) * 0.3 / 10, generator), 1)


def translate_x(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Shift horizontally by ``int(level * W / 30)`` pixels (a third of the width at level 10), either way."""
    return translate_by(
        image, _random_sign(int(_sample_level(severity, generator) * image.shape[2] / 30), generator), 0
    )


def translate_y(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Shift vertically by ``int(level * H / 30)`` pixels (a third of the height at level 10), either way."""
    return translate_by(
        image, _random_sign(int(_sample_level(severity, generator) * image.shape[1] / 30), generator), 1
    )


def shear_by(image: torch.Tensor, factor: float, axis: int) -> torch.Tensor:
    """``image`` sheared along x (``axis=0``: pixel ``(x, y)`` shows ``(x + factor * y, y)``) or y (``axis=1``)."""
    return _affine(image, (1, factor, 0, 0, 1, 0) if axis == 0 else (1, 0, 0, factor, 1, 0))


def translate_by(image: torch.Tensor, pixels: float, axis: int) -> torch.Tensor:
    """``image`` whose pixel ``(x, y)`` shows ``(x + pixels, y)`` (``axis=0``) or ``(x, y + pixels)`` (``axis=1``)."""
    return _affine(image, (1, 0, pixels, 0, 1, 0) if axis == 0 else (1, 0, 0, 0, 1, pixels))


def _symmetric_factor(severity: float, generator: torch.Generator | None) -> float:
    """An enhancement factor on either side of 1: in ``[1, severity]`` or ``[1 - 0.09 * severity, 1]``."""
    if _uniform(0.0, 1.0, generator) > 0.5:
        return _uniform(1.0, max(severity, 1.0), generator)
    return _uniform(1.0 - 0.09 * severity, 1.0, generator)


def _original_factor(severity: float, generator: torch.Generator | None) -> float:
    """The AugMix reference code's factor: ``0.1 + 0.18 * level``."""
    return _sample_level(severity, generator) * 1.8 / 10 + 0.1


def color_by(image: torch.Tensor, factor: float) -> torch.Tensor:
    """PIL's ``ImageEnhance.Color``: blend with the grayscale image (0: gray, 1: unchanged)."""
    return _blend(_grayscale(image).expand_as(image), image, factor)


def contrast_by(image: torch.Tensor, factor: float) -> torch.Tensor:
    """PIL's ``ImageEnhance.Contrast``: blend with the mean gray level (0: flat gray, 1: unchanged)."""
    mean = torch.round(_grayscale(image).mean() * 255) / 255
    return _blend(torch.full_like(image, float(mean)), image, factor)


def brightness_by(image: torch.Tensor, factor: float) -> torch.Tensor:
    """PIL's ``ImageEnhance.Brightness``: blend with black (0: black, 1: unchanged)."""
    return _blend(torch.zeros_like(image), image, factor)


def sharpness_by(image: torch.Tensor, factor: float) -> torch.Tensor:
    """PIL's ``ImageEnhance.Sharpness``: blend with the image smoothed by ``[[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13``
    (the border pixels stay as they are)."""
    kernel = torch.ones(3, 3, dtype=image.dtype, device=image.device)
    kernel[1, 1] = 5
    kernel = (kernel / 13).expand(image.shape[0], 1, 3, 3)
    smoothed = image.clone()
    if image.shape[1] > 2 and image.shape[2] > 2:
        smoothed[:, 1:-1, 1:-1] = F.conv2d(image[None], kernel, groups=image.shape[0])[0]
    return _blend(smoothed, image, factor)


def color(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Change the saturation (blend with the grayscale image) by a factor on either side of 1."""
    return color_by(image, _symmetric_factor(severity, generator))


def contrast(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Change the contrast (blend with the mean gray level) by a factor on either side of 1."""
    return contrast_by(image, _symmetric_factor(severity, generator))


def brightness(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Change the brightness (blend with black) by a factor on either side of 1."""
    return brightness_by(image, _symmetric_factor(severity, generator))


def sharpness(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Change the sharpness (blend with a smoothed image) by a factor on either side of 1."""
    return sharpness_by(image, _symmetric_factor(severity, generator))


def color_original(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """:func:`color` with the AugMix reference code's factor."""
    return color_by(image, _original_factor(severity, generator))


def contrast_original(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """:func:`contrast` with the AugMix reference code's factor."""
    return contrast_by(image, _original_factor(severity, generator))


def brightness_original(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """:func:`brightness` with the AugMix reference code's factor."""
    return brightness_by(image, _original_factor(severity, generator))


def sharpness_original(image: torch.Tensor, severity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """:func:`sharpness` with the AugMix reference code's factor."""
    return sharpness_by(image, _original_factor(severity, generator))


_SAFE: tuple[Augmentation, ...] = (
    autocontrast,
    equalize,
    posterize,
    rotate,
    solarize,
    shear_x,
    shear_y,
    translate_x,
    translate_y,
)

#: The operations of each named set (see the module docstring).
AUGMENTATION_SETS: dict[str, tuple[Augmentation, ...]] = {
    "all": (*_SAFE, color, contrast, brightness, sharpness),
    "safe": _SAFE,
    "original": (*_SAFE, color_original, contrast_original, brightness_original, sharpness_original),
}


def check_augmentation_set(method: str, augmentation_set: str) -> str:
    """``augmentation_set`` if it names a set, else ``ValueError``."""
    if augmentation_set not in AUGMENTATION_SETS:
        raise ValueError(
            f"{method}: augmentation_set={augmentation_set!r} is not a set; accepted: {list(AUGMENTATION_SET_NAMES)}."
        )
    return augmentation_set


def resolve_augmentation_set(method: str, augmentation_set: str | Sequence[Augmentation]) -> tuple[Augmentation, ...]:
    """The operations named by ``augmentation_set`` (a set's name, or the operations themselves)."""
    if isinstance(augmentation_set, str):
        return AUGMENTATION_SETS[check_augmentation_set(method, augmentation_set)]
    operations = tuple(augmentation_set)
    if not operations or not all(callable(operation) for operation in operations):
        raise ValueError(
            f"{method}: augmentation_set must name a set ({list(AUGMENTATION_SET_NAMES)}) or be a non-empty "
            f"sequence of operations, got {augmentation_set!r}."
        )
    return operations


def check_severity(method: str, severity: float) -> float:
    if isinstance(severity, bool) or not isinstance(severity, int | float) or not 0 <= severity <= 10:
        raise ValueError(f"{method}: severity={severity!r} must be a number from 0 to 10.")
    return severity


def choose(operations: Sequence[Augmentation], generator: torch.Generator | None) -> Augmentation:
    """One of ``operations``, uniformly at random."""
    return operations[int(torch.randint(len(operations), (), generator=generator))]


def as_float_image(method: str, image: object) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
    """``image`` as a float ``(C, H, W)`` tensor in ``[0, 1]``, and the function that gives a result its type back.

    Accepted: a float tensor with values in ``[0, 1]``, a ``uint8`` tensor (levels 0..255), or a PIL image in
    mode "L" or "RGB" (when Pillow is installed). Anything else, such as an image already normalised to
    negative values, is a ``ValueError``: the operations are defined on intensities.
    """
    if not isinstance(image, torch.Tensor):
        return _pil_as_float_image(method, image)
    if image.ndim != 3 or image.shape[0] not in (1, 3):
        raise ValueError(f"{method} needs an image shaped (C, H, W) with C 1 or 3, got shape {tuple(image.shape)}.")
    if image.dtype == torch.uint8:
        return image.float() / 255, lambda result: (result * 255).round().clamp(0, 255).to(torch.uint8)
    if not image.is_floating_point():
        raise ValueError(f"{method} needs a float image in [0, 1] or a uint8 image, got dtype {image.dtype}.")
    low, high = float(image.min()), float(image.max())
    if low < -1e-6 or high > 1 + 1e-6:
        raise ValueError(
            f"{method} needs float images with values in [0, 1] (apply it before normalising); this one spans "
            f"[{low:.3g}, {high:.3g}]."
        )
    dtype = image.dtype
    return image.float().clamp(0, 1), lambda result: result.to(dtype)


def _pil_as_float_image(method: str, image: object) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
    if not type(image).__module__.startswith("PIL."):
        raise ValueError(f"{method} needs an image tensor (C, H, W) or a PIL image, got {type(image).__name__}.")
    import numpy as np
    from PIL import Image

    assert isinstance(image, Image.Image)
    mode = image.mode
    if mode not in ("L", "RGB"):
        raise ValueError(f"{method} takes PIL images in mode 'L' or 'RGB', got mode {mode!r}.")
    array = torch.from_numpy(np.array(image, dtype=np.uint8))
    tensor = (array[None] if mode == "L" else array.permute(2, 0, 1)).float() / 255

    def back(result: torch.Tensor) -> object:
        levels = (result * 255).round().clamp(0, 255).to(torch.uint8)
        pixels = levels[0] if mode == "L" else levels.permute(1, 2, 0)
        return Image.fromarray(pixels.contiguous().numpy())

    return tensor, back


class Then:
    """A dataset transform: ``first`` (if any), then ``augment``."""

    def __init__(self, first: Callable[[Any], Any] | None, augment: Callable[[Any], Any]) -> None:
        self.first, self.augment = first, augment

    def __call__(self, image: Any) -> Any:
        return self.augment(image if self.first is None else self.first(image))

    def __repr__(self) -> str:
        return f"Then({self.first!r}, {self.augment!r})"


def add_dataset_transform(method: str, state: State, augment: Callable[[Any], Any]) -> None:
    """Run ``augment`` after the train dataset's ``transform`` (once: a second fit() adds nothing)."""
    dataset = getattr(state.dataloader, "dataset", None)
    if dataset is None or not hasattr(dataset, "transform"):
        kind = type(dataset).__name__ if dataset is not None else type(state.dataloader).__name__
        raise TypeError(
            f"{method} adds its augmentation to the train dataset's `transform` attribute (torchvision's "
            f"convention: a callable applied to each image), but the {kind} has none. Give the dataset a "
            "`transform` applied to each image in __getitem__, or call the functional form in it."
        )
    transform = dataset.transform
    while isinstance(transform, Then):
        if transform.augment is augment:
            return
        transform = transform.first
    dataset.transform = Then(dataset.transform, augment)
