"""Surgery on PyTorch transformer layers turns off their fused inference paths, which would bypass it."""

from __future__ import annotations

import torch
from torch import nn

from fabric.trainer.algorithms.factorize import apply_factorization
from fabric.trainer.algorithms.transformer_paths import disable_fused_transformer_paths


def _encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, batch_first=True), 2).eval()


def test_untouched_layers_keep_their_fused_path() -> None:
    encoder = _encoder()
    assert disable_fused_transformer_paths(encoder) == []
    assert encoder.layers[0].activation_relu_or_gelu == 1 and encoder.use_nested_tensor


def test_a_factorized_encoder_runs_in_eval_without_grad() -> None:
    encoder = _encoder()
    apply_factorization(encoder, min_features=16, latent_features=4)
    assert type(encoder.layers[0].linear1) is not nn.Linear
    assert not encoder.use_nested_tensor and encoder.layers[0].activation_relu_or_gelu == 0
    x = torch.randn(2, 5, 32)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0, -1] = True
    with torch.no_grad():  # the fused path would read linear1.weight, which a factorized layer has not
        fused_conditions = encoder(x, src_key_padding_mask=padding)
    torch.testing.assert_close(fused_conditions[1], encoder(x, src_key_padding_mask=padding)[1])
