"""Training methods (MixUp, EMA, BlurPool, ...) as Algorithms, each with a plain-function form.

Names load on first use, so ``import fabric.trainer.algorithms`` does not import every method. The
plain functions, for a custom Fabric loop, are in :mod:`fabric.trainer.functional`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.trainer.algorithms.blurpool import BlurPool
    from fabric.trainer.algorithms.channels_last import ChannelsLast
    from fabric.trainer.algorithms.colout import ColOut
    from fabric.trainer.algorithms.cutmix import CutMix
    from fabric.trainer.algorithms.cutout import CutOut
    from fabric.trainer.algorithms.ema import EMA
    from fabric.trainer.algorithms.factorize import Factorize
    from fabric.trainer.algorithms.ghost_batchnorm import GhostBatchNorm
    from fabric.trainer.algorithms.gradient_clipping import GradientClipping
    from fabric.trainer.algorithms.label_smoothing import LabelSmoothing
    from fabric.trainer.algorithms.layer_freezing import LayerFreezing
    from fabric.trainer.algorithms.mixup import MixUp
    from fabric.trainer.algorithms.progressive_resizing import ProgressiveResizing
    from fabric.trainer.algorithms.sam import SAM
    from fabric.trainer.algorithms.selective_backprop import SelectiveBackprop
    from fabric.trainer.algorithms.seq_length_warmup import SeqLengthWarmup
    from fabric.trainer.algorithms.stochastic_depth import StochasticDepth
    from fabric.trainer.algorithms.swa import SWA
    from fabric.trainer.algorithms.weight_standardization import WeightStandardization

_MODULE_OF = {
    "BlurPool": "blurpool",
    "ChannelsLast": "channels_last",
    "ColOut": "colout",
    "CutMix": "cutmix",
    "CutOut": "cutout",
    "EMA": "ema",
    "Factorize": "factorize",
    "GhostBatchNorm": "ghost_batchnorm",
    "GradientClipping": "gradient_clipping",
    "LabelSmoothing": "label_smoothing",
    "LayerFreezing": "layer_freezing",
    "MixUp": "mixup",
    "ProgressiveResizing": "progressive_resizing",
    "SAM": "sam",
    "SWA": "swa",
    "SelectiveBackprop": "selective_backprop",
    "SeqLengthWarmup": "seq_length_warmup",
    "StochasticDepth": "stochastic_depth",
    "WeightStandardization": "weight_standardization",
}

__all__ = [
    "BlurPool",
    "ChannelsLast",
    "ColOut",
    "CutMix",
    "CutOut",
    "EMA",
    "Factorize",
    "GhostBatchNorm",
    "GradientClipping",
    "LabelSmoothing",
    "LayerFreezing",
    "MixUp",
    "ProgressiveResizing",
    "SAM",
    "SWA",
    "SelectiveBackprop",
    "SeqLengthWarmup",
    "StochasticDepth",
    "WeightStandardization",
]
__getattr__ = lazy_exports(__name__, {name: f"{__name__}.{module}" for name, module in _MODULE_OF.items()})
