"""Training methods (MixUp, EMA, BlurPool, ...) as Algorithms, each with a plain-function form.

Names load on first use, so ``import fabric.trainer.algorithms`` does not import every method. The
plain functions, for a custom Fabric loop, are in :mod:`fabric.trainer.functional`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.trainer.algorithms.alibi import Alibi as Alibi
    from fabric.trainer.algorithms.augmix import AugMix as AugMix
    from fabric.trainer.algorithms.blurpool import BlurPool as BlurPool
    from fabric.trainer.algorithms.channels_last import ChannelsLast as ChannelsLast
    from fabric.trainer.algorithms.colout import ColOut as ColOut
    from fabric.trainer.algorithms.cutmix import CutMix as CutMix
    from fabric.trainer.algorithms.cutout import CutOut as CutOut
    from fabric.trainer.algorithms.ema import EMA as EMA
    from fabric.trainer.algorithms.factorize import Factorize as Factorize
    from fabric.trainer.algorithms.gated_linear_units import GatedLinearUnits as GatedLinearUnits
    from fabric.trainer.algorithms.ghost_batchnorm import GhostBatchNorm as GhostBatchNorm
    from fabric.trainer.algorithms.gradient_clipping import GradientClipping as GradientClipping
    from fabric.trainer.algorithms.gyro_dropout import GyroDropout as GyroDropout
    from fabric.trainer.algorithms.label_smoothing import LabelSmoothing as LabelSmoothing
    from fabric.trainer.algorithms.layer_freezing import LayerFreezing as LayerFreezing
    from fabric.trainer.algorithms.low_precision_groupnorm import LowPrecisionGroupNorm as LowPrecisionGroupNorm
    from fabric.trainer.algorithms.low_precision_layernorm import LowPrecisionLayerNorm as LowPrecisionLayerNorm
    from fabric.trainer.algorithms.mixup import MixUp as MixUp
    from fabric.trainer.algorithms.progressive_resizing import ProgressiveResizing as ProgressiveResizing
    from fabric.trainer.algorithms.randaugment import RandAugment as RandAugment
    from fabric.trainer.algorithms.sam import SAM as SAM
    from fabric.trainer.algorithms.selective_backprop import SelectiveBackprop as SelectiveBackprop
    from fabric.trainer.algorithms.seq_length_warmup import SeqLengthWarmup as SeqLengthWarmup
    from fabric.trainer.algorithms.squeeze_excite import SqueezeExcite as SqueezeExcite
    from fabric.trainer.algorithms.stochastic_depth import StochasticDepth as StochasticDepth
    from fabric.trainer.algorithms.swa import SWA as SWA
    from fabric.trainer.algorithms.weight_standardization import WeightStandardization as WeightStandardization

#: The registry of algorithms: class name -> the module of this package that defines it. ``__all__``, the
#: lazy exports and the tests derive from it. Adding an algorithm: its module, one entry here and its import
#: under ``TYPE_CHECKING`` above (re-exported for type checkers; a test checks that the two agree).
ALGORITHMS: dict[str, str] = {
    "Alibi": "alibi",
    "AugMix": "augmix",
    "BlurPool": "blurpool",
    "ChannelsLast": "channels_last",
    "ColOut": "colout",
    "CutMix": "cutmix",
    "CutOut": "cutout",
    "EMA": "ema",
    "Factorize": "factorize",
    "GatedLinearUnits": "gated_linear_units",
    "GhostBatchNorm": "ghost_batchnorm",
    "GradientClipping": "gradient_clipping",
    "GyroDropout": "gyro_dropout",
    "LabelSmoothing": "label_smoothing",
    "LayerFreezing": "layer_freezing",
    "LowPrecisionGroupNorm": "low_precision_groupnorm",
    "LowPrecisionLayerNorm": "low_precision_layernorm",
    "MixUp": "mixup",
    "ProgressiveResizing": "progressive_resizing",
    "RandAugment": "randaugment",
    "SAM": "sam",
    "SWA": "swa",
    "SelectiveBackprop": "selective_backprop",
    "SeqLengthWarmup": "seq_length_warmup",
    "SqueezeExcite": "squeeze_excite",
    "StochasticDepth": "stochastic_depth",
    "WeightStandardization": "weight_standardization",
}

__all__ = list(ALGORITHMS)
__getattr__ = lazy_exports(__name__, {name: f"{__name__}.{module}" for name, module in ALGORITHMS.items()})
