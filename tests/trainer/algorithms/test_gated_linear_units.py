"""GatedLinearUnits: the feed-forward block of PyTorch transformer layers becomes W2 (act(W_gate x) * W_in x), the
optimizers follow, unsupported models are refused, and a tiny transformer still learns."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabric.trainer.algorithms import GatedLinearUnits
from fabric.trainer.algorithms.factorize import apply_factorization
from fabric.trainer.algorithms.gated_linear_units import GatedLinearUnit, apply_gated_linear_units
from fabric.trainer.surgery import reapply_surgery, surgery_records


def test_the_feed_forward_block_becomes_a_gated_linear_unit() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 24, dropout=0.0, batch_first=True)
    linear2 = layer.linear2
    assert apply_gated_linear_units(layer, act_fn="silu", gated_layer_bias=True) == [""]
    glu = layer.linear1
    assert isinstance(glu, GatedLinearUnit)
    assert glu.gated_layer.weight.shape == glu.non_gated_layer.weight.shape == (24, 8)
    assert glu.gated_layer.bias is not None and glu.non_gated_layer.bias is None
    assert layer.linear2 is linear2 and isinstance(layer.activation, nn.Identity)
    x = torch.randn(2, 5, 8)
    expected = linear2(F.silu(glu.gated_layer(x)) * glu.non_gated_layer(x))
    torch.testing.assert_close(layer._ff_block(x), expected)


def test_without_act_fn_each_layer_keeps_its_own_activation() -> None:
    model = nn.Sequential(
        nn.TransformerEncoderLayer(8, 2, 16, activation="gelu"), nn.TransformerEncoderLayer(8, 2, 16, activation="relu")
    )
    assert apply_gated_linear_units(model) == ["0", "1"]
    assert model[0].linear1.act_fn is F.gelu and model[1].linear1.act_fn is F.relu  # type: ignore[union-attr]
    assert apply_gated_linear_units(model) == []  # already gated: nothing more to do


def test_decoder_layers_are_converted_too_and_the_optimizer_follows() -> None:
    layer = nn.TransformerDecoderLayer(8, 2, 16)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    old = {id(p) for p in layer.linear1.parameters()}
    apply_gated_linear_units(layer, [optimizer], act_fn=F.gelu)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert not old & optimized
    assert {id(p) for p in layer.linear1.parameters()} <= optimized
    assert optimized == {id(p) for p in layer.parameters()}


def test_an_encoder_in_eval_without_grad_does_not_take_the_fused_path() -> None:
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2).eval()
    apply_gated_linear_units(encoder, act_fn="gelu")
    x = torch.randn(2, 5, 8)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1, -1] = True
    with torch.no_grad():  # the fused path would read linear1.weight, which a GLU has not
        fused_conditions = encoder(x, src_key_padding_mask=padding)
    with_grad = encoder(x, src_key_padding_mask=padding)  # never fused
    torch.testing.assert_close(fused_conditions[0], with_grad[0])


def test_a_factorized_linear1_is_replaced_too() -> None:
    layer = nn.TransformerEncoderLayer(32, 2, 64)
    apply_factorization(layer, min_features=8, latent_features=4)
    assert not isinstance(layer.linear1, nn.Linear)
    apply_gated_linear_units(layer, act_fn="relu")
    assert layer.linear1.gated_layer.weight.shape == (64, 32)


def test_a_model_without_transformer_layers_is_refused_naming_what_is_supported() -> None:
    with pytest.raises(ValueError, match=r"TransformerEncoderLayer and TransformerDecoderLayer .* Sequential has none"):
        apply_gated_linear_units(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))


def test_a_checkpointed_surgery_replays_on_a_fresh_model() -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.TransformerEncoderLayer(8, 2, 16)

    model = build()
    algorithm = GatedLinearUnits(act_fn=nn.GELU(approximate="tanh"), non_gated_layer_bias=True)
    algorithm.apply_surgery(model)
    records = surgery_records([algorithm])
    assert records[0]["hparams"] == {"act_fn": "gelu_tanh", "gated_layer_bias": False, "non_gated_layer_bias": True}
    fresh = build()
    reapply_surgery(fresh, records)
    fresh.load_state_dict(model.state_dict())
    x = torch.randn(3, 2, 8)
    torch.testing.assert_close(fresh.eval()(x), model.eval()(x))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"act_fn": "swishy"}, r"act_fn='swishy' is not accepted: pass a callable, None .*'gelu'"),
        ({"act_fn": 3}, "act_fn=3 is not accepted"),
        ({"gated_layer_bias": 1}, "gated_layer_bias=1 must be True or False"),
        ({"act_fn": lambda x: x}, "has no name to record in a checkpoint"),
    ],
)
def test_bad_arguments_fail_at_construction(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatedLinearUnits(**arguments)


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.tokens = torch.randint(0, 12, (256, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": (self.tokens[index] * 5 + 3) % 12}


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 16)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(16, 12)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        output: torch.Tensor = self.head(self.encoder(self.embed(batch["input_ids"])))
        return output

    def loss(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(outputs.flatten(0, 1), batch["labels"].flatten())


def test_a_tiny_transformer_learns_with_gated_linear_units() -> None:
    from fabric.trainer.trainer import Trainer

    torch.manual_seed(0)
    model = TinyTransformer()
    data = Tokens()
    everything = {"input_ids": data.tokens, "labels": (data.tokens * 5 + 3) % 12}
    with torch.no_grad():
        before = model.loss(model(everything), everything).item()
    reference = copy.deepcopy(model.encoder.layers[0].linear2)
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=32),
        max_duration="4ep",
        optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
        algorithms=[GatedLinearUnits(act_fn="gelu")],
        progress_bar=False,
        seed=0,
        accelerator="cpu",
    )
    trainer.fit()
    trainer.close()
    assert all(isinstance(layer.linear1, GatedLinearUnit) for layer in model.encoder.layers)
    assert not torch.equal(model.encoder.layers[0].linear1.gated_layer.weight, torch.zeros(32, 16))
    assert not torch.equal(model.encoder.layers[0].linear2.weight, reference.weight)  # linear2 kept training
    model.eval()
    with torch.no_grad():
        after = model.loss(model(everything), everything).item()
    assert after < 0.2 * before, (before, after)
