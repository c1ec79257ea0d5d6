"""AugMix and RandAugment: the tensor operations agree with PIL's, the mixing follows the paper, both are seeded by
a generator, bad images and arguments are refused, and the algorithms augment the train dataset's transform so a
tiny classifier still learns."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fabric.trainer.algorithms import AugMix, RandAugment
from fabric.trainer.algorithms import augmentation_primitives as ops
from fabric.trainer.algorithms.augmentation_primitives import AUGMENTATION_SETS, Then
from fabric.trainer.algorithms.augmix import AugmentAndMixTransform, augmix_image, mixing_weights
from fabric.trainer.algorithms.randaugment import RandAugmentTransform, randaugment_image


def _image(channels: int = 3, height: int = 17, width: int = 23, seed: int = 0) -> torch.Tensor:
    """A float image on exact 8-bit levels, away from 0 and 1."""
    generator = torch.Generator().manual_seed(seed)
    return ((torch.rand(channels, height, width, generator=generator) * 0.6 + 0.2) * 255).round() / 255


# --- the operations, against PIL ----------------------------------------------------------------------------


def _pil_pair() -> tuple[torch.Tensor, Any, Any]:
    pytest.importorskip("PIL")
    import numpy as np
    from PIL import Image

    image = _image()
    pil = Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy())

    def tensor(result: Any) -> torch.Tensor:
        return torch.from_numpy(np.array(result)).permute(2, 0, 1).float() / 255

    return image, pil, tensor


def test_level_operations_equal_pils() -> None:
    from PIL import ImageOps

    image, pil, tensor = _pil_pair()
    assert torch.equal(ops.equalize(image, 3), tensor(ImageOps.equalize(pil)))
    assert torch.equal(ops.posterize_to(image, 3), tensor(ImageOps.posterize(pil, 3)))
    assert torch.equal(ops.solarize_at(image, 140), tensor(ImageOps.solarize(pil, 140)))
    torch.testing.assert_close(ops.autocontrast(image, 3), tensor(ImageOps.autocontrast(pil)), atol=1.5 / 255, rtol=0)


@pytest.mark.parametrize("factor", [0.3, 1.7])
@pytest.mark.parametrize("name", ["Color", "Contrast", "Brightness", "Sharpness"])
def test_enhancements_equal_pils_up_to_rounding(name: str, factor: float) -> None:
    from PIL import ImageEnhance

    image, pil, tensor = _pil_pair()
    ours = getattr(ops, f"{name.lower()}_by")(image, factor)
    theirs = tensor(getattr(ImageEnhance, name)(pil).enhance(factor))
    torch.testing.assert_close(ours, theirs, atol=2 / 255, rtol=0)


def test_geometric_operations_match_pils_away_from_the_borders() -> None:
    from PIL import Image

    image, pil, tensor = _pil_pair()
    torch.testing.assert_close(
        ops.translate_by(image, 3, 0), tensor(pil.transform(pil.size, Image.Transform.AFFINE, (1, 0, 3, 0, 1, 0)))
    )
    pairs = [
        (ops.rotate_by(image, 10), pil.rotate(10, resample=Image.Resampling.BILINEAR)),
        (
            ops.shear_by(image, 0.2, 0),
            pil.transform(pil.size, Image.Transform.AFFINE, (1, 0.2, 0, 0, 1, 0), Image.Resampling.BILINEAR),
        ),
        (
            ops.shear_by(image, -0.2, 1),
            pil.transform(pil.size, Image.Transform.AFFINE, (1, 0, 0, -0.2, 1, 0), Image.Resampling.BILINEAR),
        ),
    ]
    for ours, theirs in pairs:
        difference = (ours - tensor(theirs)).abs()
        assert difference.mean() < 0.02  # PIL treats the edge pixels differently; the rest agree
        assert difference[:, 4:-4, 6:-6].max() < 2 / 255


def test_strength_grows_with_severity() -> None:
    image = _image()
    generator = torch.Generator().manual_seed(0)
    mild = [(ops.rotate(image, 1, generator) - image).abs().mean() for _ in range(20)]
    strong = [(ops.rotate(image, 10, generator) - image).abs().mean() for _ in range(20)]
    assert sum(strong) > 2 * sum(mild)


def test_the_sets_are_composers() -> None:
    names = {key: [op.__name__ for op in value] for key, value in AUGMENTATION_SETS.items()}
    safe = ["autocontrast", "equalize", "posterize", "rotate", "solarize", "shear_x", "shear_y", "translate_x"]
    assert names["safe"] == [*safe, "translate_y"]
    assert names["all"] == [*safe, "translate_y", "color", "contrast", "brightness", "sharpness"]
    assert names["original"][-4:] == [
        "color_original",
        "contrast_original",
        "brightness_original",
        "sharpness_original",
    ]


# --- AugMix --------------------------------------------------------------------------------------------------


def test_mixing_weights_are_dirichlet_and_beta() -> None:
    generator = torch.Generator().manual_seed(0)
    draws = [mixing_weights(3, 1.0, generator) for _ in range(2000)]
    weights = torch.stack([w for w, _ in draws])
    blends = torch.tensor([m for _, m in draws])
    torch.testing.assert_close(weights.sum(1), torch.ones(2000))
    assert (weights >= 0).all() and ((blends >= 0) & (blends <= 1)).all()
    torch.testing.assert_close(weights.mean(0), torch.full((3,), 1 / 3), atol=0.02, rtol=0)
    assert abs(float(blends.mean()) - 0.5) < 0.03 and abs(float(blends.var()) - 1 / 12) < 0.01  # Beta(1, 1)
    peaked = torch.tensor([mixing_weights(3, 100.0, generator)[1] for _ in range(200)])
    assert peaked.std() < 0.06  # Beta(100, 100) is concentrated at 0.5


def test_augmix_blends_the_image_with_the_weighted_chains() -> None:
    image = _image()

    def darken(x: torch.Tensor, severity: float, generator: torch.Generator | None) -> torch.Tensor:
        return x * 0.5

    result = augmix_image(
        image, depth=1, width=3, alpha=1.0, augmentation_set=[darken], generator=torch.Generator().manual_seed(4)
    )
    _, blend = mixing_weights(3, 1.0, torch.Generator().manual_seed(4))
    # every chain is image / 2 and the weights sum to 1: (1 - m) * image + m * image / 2
    torch.testing.assert_close(result, image * (1 - blend / 2))


def test_augmix_is_deterministic_under_a_generator_and_keeps_shape_dtype_and_range() -> None:
    image = _image()
    first = augmix_image(image, severity=5, generator=torch.Generator().manual_seed(1))
    again = augmix_image(image, severity=5, generator=torch.Generator().manual_seed(1))
    other = augmix_image(image, severity=5, generator=torch.Generator().manual_seed(2))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.shape == image.shape and first.dtype == image.dtype
    assert float(first.min()) >= 0 and float(first.max()) <= 1
    assert not torch.equal(first, image)
    levels = (image * 255).round().byte()
    as_levels = augmix_image(levels, severity=5, generator=torch.Generator().manual_seed(1))
    assert as_levels.dtype == torch.uint8 and as_levels.shape == levels.shape
    assert (as_levels.float() / 255 - first).abs().max() <= 1 / 255


def test_pil_images_come_back_as_pil_images() -> None:
    pytest.importorskip("PIL")
    from PIL import Image

    gray = Image.fromarray((_image(1)[0] * 255).round().byte().numpy())
    result = augmix_image(gray, generator=torch.Generator().manual_seed(0))
    assert isinstance(result, Image.Image) and result.mode == "L" and result.size == gray.size
    _, pil, _ = _pil_pair()
    result = randaugment_image(pil, generator=torch.Generator().manual_seed(0))
    assert isinstance(result, Image.Image) and result.mode == "RGB" and result.size == pil.size


@pytest.mark.parametrize("function", [augmix_image, randaugment_image])
def test_images_that_are_not_intensities_are_refused(function: Any) -> None:
    with pytest.raises(ValueError, match=r"values in \[0, 1\] \(apply it before normalising\)"):
        function(torch.randn(3, 8, 8) * 2)
    with pytest.raises(ValueError, match=r"shaped \(C, H, W\) with C 1 or 3, got shape \(2, 3, 8, 8\)"):
        function(torch.rand(2, 3, 8, 8))
    with pytest.raises(ValueError, match=r"got dtype torch\.int64"):
        function(torch.zeros(3, 4, 4, dtype=torch.long))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"severity": 11}, "severity=11 must be a number from 0 to 10"),
        ({"depth": 0}, r"depth=0 must be -1 \(1 to 3 at random\) or a positive integer"),
        ({"width": 0}, "width=0 must be a positive integer"),
        ({"alpha": 0.0}, "alpha=0.0 must be a positive number"),
        (
            {"augmentation_set": "most"},
            r"augmentation_set='most' is not a set; accepted: \['all', 'safe', 'original'\]",
        ),
    ],
)
def test_bad_augmix_arguments_fail_at_construction(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"AugMix: {message}"):
        AugMix(**arguments)


# --- RandAugment ---------------------------------------------------------------------------------------------


def test_randaugment_applies_depth_operations_drawn_from_the_set() -> None:
    calls: list[str] = []

    def tagged(name: str) -> Any:
        def op(x: torch.Tensor, severity: float, generator: torch.Generator | None) -> torch.Tensor:
            calls.append(name)
            return x

        return op

    image = _image()
    result = randaugment_image(
        image, 4, depth=5, augmentation_set=[tagged("a"), tagged("b")], generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(result, image) and len(calls) == 5 and set(calls) <= {"a", "b"}
    assert torch.equal(randaugment_image(image, depth=0), image)
    first = randaugment_image(image, generator=torch.Generator().manual_seed(3))
    assert torch.equal(first, randaugment_image(image, generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"severity": -1}, "severity=-1 must be a number from 0 to 10"),
        ({"depth": -1}, "depth=-1 must be a non-negative integer"),
        ({"augmentation_set": "none"}, "augmentation_set='none' is not a set"),
    ],
)
def test_bad_randaugment_arguments_fail_at_construction(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"RandAugment: {message}"):
        RandAugment(**arguments)


# --- the algorithms in a Trainer -----------------------------------------------------------------------------


def _patterns(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Horizontal stripes, vertical stripes or a checkerboard (period 4), with noise, in [0, 1]."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (count,), generator=generator)
    rows = (torch.arange(12) // 2 % 2).float()
    stripes = [rows[:, None].expand(12, 12), rows[None, :].expand(12, 12), (rows[:, None] + rows[None, :]) % 2]
    images = torch.stack([stripes[int(label)] for label in labels])[:, None]
    return (0.2 + 0.6 * images + 0.1 * torch.randn(images.shape, generator=generator)).clamp(0, 1), labels


class Patterns(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A torchvision-style dataset: ``transform`` is applied to each image."""

    def __init__(self) -> None:
        self.images, self.labels = _patterns(192, seed=0)
        self.transform: Any = None
        self.seen: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index] if self.transform is None else self.transform(self.images[index])
        if index == 0:
            self.seen.append(image)
        return image, self.labels[index]


class PatternNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 8, 3, padding=1), nn.Linear(8, 3)

    def forward(self, batch: Any) -> torch.Tensor:
        output: torch.Tensor = self.head(torch.relu(self.conv(batch[0] - 0.5)).mean(dim=(2, 3)))
        return output

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1])


@pytest.mark.parametrize(
    "algorithm",
    [AugMix(severity=3, width=2), RandAugment(severity=5, depth=1, augmentation_set="safe")],
    ids=["AugMix", "RandAugment"],
)
def test_a_tiny_classifier_learns_on_augmented_images(algorithm: Any) -> None:
    from fabric.trainer.trainer import Trainer

    torch.manual_seed(0)
    data = Patterns()
    model = PatternNet()
    batch = (data.images, data.labels)
    with torch.no_grad():
        before = model.loss(model(batch), batch).item()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=32, shuffle=True),
        max_duration="10ep",
        optimizers=torch.optim.Adam(model.parameters(), lr=0.03),
        algorithms=[algorithm],
        progress_bar=False,
        seed=0,
        accelerator="cpu",
    )
    trainer.fit()
    assert isinstance(data.transform, Then) and data.transform.augment is algorithm.transform
    assert len(data.seen) == 10 and not any(torch.equal(seen, data.images[0]) for seen in data.seen)
    trainer.fit(duration="1ep")  # a second fit() adds no second augmentation
    assert data.transform.first is None
    trainer.close()
    with torch.no_grad():
        after = model.loss(model(batch), batch).item()
    assert after < 0.5 * before, (before, after)


def test_the_dataset_transform_runs_before_the_augmentation() -> None:
    def to_unit(x: torch.Tensor) -> torch.Tensor:
        return x.float() / 255

    transform = Then(to_unit, RandAugmentTransform(depth=0))
    levels = torch.full((3, 4, 4), 51, dtype=torch.uint8)
    torch.testing.assert_close(transform(levels), torch.full((3, 4, 4), 0.2))
    assert isinstance(AugmentAndMixTransform()(levels), torch.Tensor)


def test_a_dataset_without_a_transform_attribute_is_refused() -> None:
    from fabric.trainer.trainer import Trainer

    images, labels = _patterns(8, seed=0)
    model = PatternNet()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(images, labels), batch_size=4),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=[AugMix()],
        progress_bar=False,
        accelerator="cpu",
    )
    with pytest.raises(
        TypeError, match=r"AugMix adds its augmentation to the train dataset's `transform` .*TensorDataset has none"
    ):
        trainer.fit()
    trainer.close()


def test_math_sanity_of_the_rotation_matrix() -> None:
    image = torch.zeros(1, 9, 9)
    image[0, 4, 8] = 1.0  # right of the centre
    rotated = ops.rotate_by(image, 90)  # counter-clockwise on screen: to the top
    assert rotated[0, 0, 4] > 0.9 and math.isclose(float(rotated.sum()), 1.0, abs_tol=1e-5)
