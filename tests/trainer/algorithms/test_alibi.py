"""Alibi: the paper's slopes and biases, patched nn.MultiheadAttention equal to attention given the bias as a mask,
position embeddings dropped, unsupported models refused, and a tiny causal model that learns with it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabric.trainer.algorithms import Alibi
from fabric.trainer.algorithms.alibi import AlibiMultiheadAttention, alibi_bias, alibi_slopes, apply_alibi
from fabric.trainer.surgery import reapply_surgery, surgery_records


def test_slopes_for_a_power_of_two_are_the_papers_geometric_sequence() -> None:
    assert alibi_slopes(8).tolist() == [1 / 2**k for k in range(1, 9)]
    assert alibi_slopes(4).tolist() == [1 / 4, 1 / 16, 1 / 64, 1 / 256]
    assert alibi_slopes(1).tolist() == [1 / 256]


def test_slopes_for_other_head_counts_interleave_the_next_power_of_two() -> None:
    # 6 heads: the 4 slopes of 4 heads, then every other slope of 8 heads (as the paper's code does)
    assert alibi_slopes(6).tolist() == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
    assert alibi_slopes(12).tolist() == [2 ** (-k) for k in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]


def test_the_bias_is_minus_slope_times_distance_with_queries_at_the_end_of_the_keys() -> None:
    bias = alibi_bias(2, 3, dtype=torch.float64)
    expected_distance = torch.tensor([[0.0, 1, 2], [1, 0, 1], [2, 1, 0]], dtype=torch.float64)
    torch.testing.assert_close(bias[0], -expected_distance / 16)
    torch.testing.assert_close(bias[1], -expected_distance / 256)
    longer_keys = alibi_bias(1, 2, 4, dtype=torch.float64)[0]  # queries are keys 2 and 3
    torch.testing.assert_close(longer_keys, -torch.tensor([[2.0, 1, 0, 1], [3, 2, 1, 0]], dtype=torch.float64) / 256)


def _reference(attention: nn.MultiheadAttention, x: torch.Tensor, mask: torch.Tensor | None, **kwargs: Any) -> Any:
    """The unpatched module given the ALiBi bias (plus ``mask``) as its additive per-head mask."""
    batch, length = (x.shape[0], x.shape[1]) if attention.batch_first else (x.shape[1], x.shape[0])
    bias = alibi_bias(attention.num_heads, length).repeat(batch, 1, 1)
    if mask is not None:
        bias = bias + (torch.zeros(mask.shape).masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else mask)
    return attention(x, x, x, attn_mask=bias, **kwargs)


@pytest.mark.parametrize("batch_first", [True, False])
def test_patched_attention_equals_attention_given_the_bias_as_mask(batch_first: bool) -> None:
    torch.manual_seed(0)
    original = nn.MultiheadAttention(16, 4, batch_first=batch_first).eval()
    patched = AlibiMultiheadAttention.from_attention(copy.deepcopy(original), max_sequence_length=64)
    assert all(a is not b for a, b in zip(patched.parameters(), original.parameters(), strict=True))
    assert list(patched.state_dict()) == list(original.state_dict())
    x = torch.randn(3, 7, 16) if batch_first else torch.randn(7, 3, 16)
    output, weights = patched(x, x, x)
    expected, expected_weights = _reference(original, x, None)
    torch.testing.assert_close(output, expected)
    torch.testing.assert_close(weights, expected_weights)
    # a causal (additive) mask and padded keys
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[0, -2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(7)
    output, _ = patched(x, x, x, key_padding_mask=padding, attn_mask=causal, is_causal=True, need_weights=False)
    float_padding = torch.zeros(3, 7).masked_fill(padding, float("-inf"))
    expected, _ = _reference(original, x, causal, key_padding_mask=float_padding, need_weights=False)
    torch.testing.assert_close(output, expected)


def test_is_causal_without_a_mask_is_a_causal_mask() -> None:
    torch.manual_seed(0)
    patched = AlibiMultiheadAttention.from_attention(nn.MultiheadAttention(8, 2, batch_first=True), 16).eval()
    x = torch.randn(2, 5, 8)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    torch.testing.assert_close(patched(x, x, x, is_causal=True)[0], patched(x, x, x, attn_mask=causal)[0])
    # the first position attends only to itself: its output does not depend on later tokens
    changed = x.clone()
    changed[:, 1:] += 1.0
    first = patched(x, x, x, is_causal=True)[0][:, 0]
    torch.testing.assert_close(patched(changed, changed, changed, is_causal=True)[0][:, 0], first)


def test_an_encoder_in_eval_uses_the_bias_instead_of_its_fused_path() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    reference = copy.deepcopy(encoder)
    apply_alibi(encoder, max_sequence_length=32)
    x = torch.randn(2, 6, 16)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, -2:] = True
    with torch.no_grad():  # the fused paths need no_grad and eval: they must not run (they would skip the bias)
        output = encoder(x, src_key_padding_mask=padding)
        bias = alibi_bias(4, 6).repeat(2, 1, 1)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            float_padding = torch.zeros(2, 6).masked_fill(padding, float("-inf"))
            expected = reference(x, mask=bias, src_key_padding_mask=float_padding)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    torch.testing.assert_close(output[0], expected[0])
    torch.testing.assert_close(output[1, :4], expected[1, :4])


def test_sequences_longer_than_max_sequence_length_are_refused() -> None:
    patched = AlibiMultiheadAttention.from_attention(nn.MultiheadAttention(8, 2), max_sequence_length=4)
    with pytest.raises(ValueError, match="longer than max_sequence_length=4"):
        patched(torch.randn(5, 1, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8))


def test_a_model_without_multihead_attention_is_refused_naming_what_is_supported() -> None:
    with pytest.raises(ValueError, match=r"torch\.nn\.MultiheadAttention .*Sequential has none"):
        apply_alibi(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="MultiheadAttention"):
        Alibi().apply_surgery(nn.Sequential(nn.Conv2d(1, 1, 1)))


def test_decoder_cross_attention_is_left_alone() -> None:
    decoder = nn.TransformerDecoderLayer(8, 2, 16, batch_first=True)
    patched = apply_alibi(decoder)
    assert patched == ["self_attn"]
    assert isinstance(decoder.self_attn, AlibiMultiheadAttention)
    assert type(decoder.multihead_attn) is nn.MultiheadAttention


class TokenModel(nn.Module):
    """Tokens plus learned positions, one causal encoder layer, a per-token head; dict batches."""

    def __init__(self, vocab: int = 8, width: int = 32, positions: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position_embeddings = nn.Embedding(positions, width)
        self.layer = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, vocab)
        self.lengths: list[tuple[int, ...]] = []

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = batch["input_ids"]
        self.lengths.append(tuple(tokens.shape))
        positions = torch.arange(tokens.shape[1])
        hidden = self.embed(tokens) + self.position_embeddings(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        output: torch.Tensor = self.head(self.layer(hidden, src_mask=mask, is_causal=True))
        return output

    def loss(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(outputs.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def test_position_embeddings_are_zeroed_frozen_resized_and_leave_the_optimizer() -> None:
    model = TokenModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    old = model.position_embeddings.weight
    apply_alibi(model, max_sequence_length=24, optimizers=[optimizer])
    assert model.position_embeddings.weight.shape == (24, 32)
    assert not model.position_embeddings.weight.requires_grad and not model.position_embeddings.weight.any()
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(old) not in optimized and id(model.position_embeddings.weight) not in optimized
    assert id(model.layer.self_attn.in_proj_weight) in optimized  # shared, so still optimized


def test_a_checkpointed_surgery_replays_on_a_fresh_model() -> None:
    model = TokenModel()
    algorithm = Alibi(max_sequence_length=20, train_sequence_length_scaling=1.0)
    algorithm.apply_surgery(model)
    fresh = TokenModel()
    reapply_surgery(fresh, surgery_records([algorithm]))
    fresh.load_state_dict(model.state_dict())
    assert isinstance(fresh.layer.self_attn, AlibiMultiheadAttention)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"max_sequence_length": 0}, "max_sequence_length=0 must be a positive integer"),
        ({"train_sequence_length_scaling": 0.0}, r"train_sequence_length_scaling=0.0 must be a fraction in \(0, 1\]"),
        ({"train_sequence_length_scaling": 1.5}, "train_sequence_length_scaling=1.5"),
        ({"position_embedding_names": "wpe"}, "position_embedding_names='wpe' must be a sequence of attribute names"),
    ],
)
def test_bad_arguments_fail_at_construction(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Alibi(**arguments)


class PreviousToken(Dataset[dict[str, torch.Tensor]]):
    """Label at position t is the token at t - 1: only attention that knows relative positions can learn it."""

    def __init__(self, count: int = 256, length: int = 16) -> None:
        self.tokens = torch.randint(0, 8, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[index]
        labels = torch.cat([torch.tensor([-100]), tokens[:-1]])
        return {"input_ids": tokens, "labels": labels}


def test_a_tiny_causal_model_learns_to_copy_the_previous_token_with_alibi_and_shorter_training_sequences() -> None:
    from fabric.trainer.trainer import Trainer

    torch.manual_seed(0)
    model = TokenModel()
    data = PreviousToken()
    batch = {"input_ids": data.tokens, "labels": torch.stack([data[i]["labels"] for i in range(len(data))])}
    with torch.no_grad():
        before = model.loss(model(batch), batch).item()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=32),
        max_duration="16ep",
        optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
        algorithms=[Alibi(max_sequence_length=16, train_sequence_length_scaling=0.5)],
        progress_bar=False,
        seed=0,
        accelerator="cpu",
    )
    model.lengths.clear()
    trainer.fit()
    trainer.close()
    assert set(model.lengths) == {(64, 8)}  # trained on sequences half as long, twice as many
    model.eval()
    with torch.no_grad():
        after = model.loss(model(batch), batch).item()  # evaluated on the full length
    assert after < 0.3 * before, (before, after)
