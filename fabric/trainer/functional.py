"""Every training method as a plain function for a custom Fabric loop: ``apply_blurpool(model)``, ``mixup_batch``...

The Algorithm classes (for the Trainer) are in :mod:`fabric.trainer.algorithms`; each function lives in the same
module as its algorithm, next to the schedule it follows (``resize_scale``, ``warmup_length``, ...). SWA has
no separate function: ``torch.optim.swa_utils`` is its plain form. Names load on first use, so importing this
module imports no method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.trainer.algorithms.alibi import alibi_bias, alibi_slopes, apply_alibi
    from fabric.trainer.algorithms.augmix import augmix_image
    from fabric.trainer.algorithms.blurpool import apply_blurpool, blur_2d
    from fabric.trainer.algorithms.channels_last import apply_channels_last
    from fabric.trainer.algorithms.colout import colout_batch
    from fabric.trainer.algorithms.cutmix import cutmix_batch, cutmix_box
    from fabric.trainer.algorithms.cutout import cutout_batch, cutout_mask
    from fabric.trainer.algorithms.ema import compute_ema
    from fabric.trainer.algorithms.factorize import apply_factorization
    from fabric.trainer.algorithms.gated_linear_units import apply_gated_linear_units
    from fabric.trainer.algorithms.ghost_batchnorm import apply_ghost_batchnorm
    from fabric.trainer.algorithms.gradient_clipping import adaptive_clip_grad_, apply_gradient_clipping
    from fabric.trainer.algorithms.gyro_dropout import apply_gyro_dropout
    from fabric.trainer.algorithms.label_smoothing import smooth_labels
    from fabric.trainer.algorithms.layer_freezing import freeze_fraction, freeze_layers
    from fabric.trainer.algorithms.low_precision_groupnorm import apply_low_precision_groupnorm
    from fabric.trainer.algorithms.low_precision_layernorm import apply_low_precision_layernorm
    from fabric.trainer.algorithms.mixup import mixup_batch
    from fabric.trainer.algorithms.progressive_resizing import resize_batch, resize_scale
    from fabric.trainer.algorithms.randaugment import randaugment_image
    from fabric.trainer.algorithms.sam import sam_perturbation
    from fabric.trainer.algorithms.selective_backprop import per_sample_losses, select_using_loss, should_select
    from fabric.trainer.algorithms.seq_length_warmup import set_batch_sequence_length, warmup_length
    from fabric.trainer.algorithms.squeeze_excite import apply_squeeze_excite
    from fabric.trainer.algorithms.stochastic_depth import apply_stochastic_depth
    from fabric.trainer.algorithms.weight_standardization import apply_weight_standardization

_MODULE_OF = {
    "adaptive_clip_grad_": "gradient_clipping",
    "alibi_bias": "alibi",
    "alibi_slopes": "alibi",
    "apply_alibi": "alibi",
    "apply_blurpool": "blurpool",
    "apply_channels_last": "channels_last",
    "apply_factorization": "factorize",
    "apply_gated_linear_units": "gated_linear_units",
    "apply_ghost_batchnorm": "ghost_batchnorm",
    "apply_gradient_clipping": "gradient_clipping",
    "apply_gyro_dropout": "gyro_dropout",
    "apply_low_precision_groupnorm": "low_precision_groupnorm",
    "apply_low_precision_layernorm": "low_precision_layernorm",
    "apply_squeeze_excite": "squeeze_excite",
    "apply_stochastic_depth": "stochastic_depth",
    "apply_weight_standardization": "weight_standardization",
    "augmix_image": "augmix",
    "blur_2d": "blurpool",
    "colout_batch": "colout",
    "compute_ema": "ema",
    "cutmix_batch": "cutmix",
    "cutmix_box": "cutmix",
    "cutout_batch": "cutout",
    "cutout_mask": "cutout",
    "freeze_fraction": "layer_freezing",
    "freeze_layers": "layer_freezing",
    "mixup_batch": "mixup",
    "per_sample_losses": "selective_backprop",
    "randaugment_image": "randaugment",
    "resize_batch": "progressive_resizing",
    "resize_scale": "progressive_resizing",
    "sam_perturbation": "sam",
    "select_using_loss": "selective_backprop",
    "set_batch_sequence_length": "seq_length_warmup",
    "should_select": "selective_backprop",
    "smooth_labels": "label_smoothing",
    "warmup_length": "seq_length_warmup",
}

__all__ = [
    "adaptive_clip_grad_",
    "alibi_bias",
    "alibi_slopes",
    "apply_alibi",
    "apply_blurpool",
    "apply_channels_last",
    "apply_factorization",
    "apply_gated_linear_units",
    "apply_ghost_batchnorm",
    "apply_gradient_clipping",
    "apply_gyro_dropout",
    "apply_low_precision_groupnorm",
    "apply_low_precision_layernorm",
    "apply_squeeze_excite",
    "apply_stochastic_depth",
    "apply_weight_standardization",
    "augmix_image",
    "blur_2d",
    "colout_batch",
    "compute_ema",
    "cutmix_batch",
    "cutmix_box",
    "cutout_batch",
    "cutout_mask",
    "freeze_fraction",
    "freeze_layers",
    "mixup_batch",
    "per_sample_losses",
    "randaugment_image",
    "resize_batch",
    "resize_scale",
    "sam_perturbation",
    "select_using_loss",
    "set_batch_sequence_length",
    "should_select",
    "smooth_labels",
    "warmup_length",
]
__getattr__ = lazy_exports(
    __name__, {name: f"fabric.trainer.algorithms.{module}" for name, module in _MODULE_OF.items()}
)
