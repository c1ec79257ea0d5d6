"""Keeping PyTorch's fused transformer inference paths away from layers that surgery changed.

In evaluation without gradients, ``nn.TransformerEncoderLayer`` (and ``nn.TransformerEncoder``, through nested
tensors) may skip its submodules' ``forward`` and call a fused kernel with ``self_attn.in_proj_weight``,
``linear1.weight``, ... read directly. A layer whose attention or feed-forward layers were replaced (Alibi's
attention, a GatedLinearUnit, Factorize's low-rank pair) would then lose the replacement, or fail for want of
a ``weight``. :func:`disable_fused_transformer_paths` turns those paths off for exactly such layers.
"""

from __future__ import annotations

from torch import nn


def _changed(layer: nn.TransformerEncoderLayer) -> bool:
    return (
        type(layer.self_attn) is not nn.MultiheadAttention
        or type(layer.linear1) is not nn.Linear
        or type(layer.linear2) is not nn.Linear
    )


def disable_fused_transformer_paths(model: nn.Module) -> list[str]:
    """Turn off the fused inference path of every encoder layer of ``model`` whose attention or ``linear1``/
    ``linear2`` is no longer PyTorch's own (and the nested-tensor path of encoders holding one); returns their names.

    The layer's path is off when its ``activation_relu_or_gelu`` flag is 0 (the flag is read only to choose it).
    """
    changed = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.TransformerEncoderLayer) and _changed(module)
    ]
    # torch-workaround(transformer-fused-path): the fused path skips replaced submodules' forward
    for _, layer in changed:
        layer.activation_relu_or_gelu = 0
    changed_ids = {id(layer) for _, layer in changed}
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder) and any(id(layer) in changed_ids for layer in module.layers):
            module.use_nested_tensor = False
    return [name for name, _ in changed]
