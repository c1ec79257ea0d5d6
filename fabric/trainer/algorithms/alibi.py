"""Alibi: attention with linear biases (ALiBi) instead of position embeddings.

Press, Smith and Lewis, "Train Short, Test Long: Attention with Linear Biases Enables Input Length
Extrapolation" (ICLR 2022): no position embedding is added to the tokens; instead each attention head ``h``
adds ``-m_h * |i - j|`` to the score of query ``i`` for key ``j``, with head slopes ``m_h`` a geometric
sequence (``2^(-8/H), 2^(-16/H), ..., 2^(-8)`` for ``H`` heads, a power of two; other counts interleave the
sequences of the neighbouring powers, as in the paper's code). Trained on short sequences, such a model works
on longer ones. The bias is symmetric (``|i - j|``), so it serves encoders; under a causal mask it equals the
paper's causal bias.

Composer patches Hugging Face models through a registry; this implementation supports PyTorch's own
attention: every ``nn.MultiheadAttention`` of the model (including the ``self_attn`` of
``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``; the decoder's cross-attention ``multihead_attn``
is left alone) becomes an :class:`AlibiMultiheadAttention`, which shares its parameters and adds the bias to
the attention mask it is given (boolean or additive, 2-d or per-head 3-d; ``is_causal`` is honoured). A model
without ``nn.MultiheadAttention`` is refused with a ``ValueError``. Position embeddings are the model's own
modules: every ``nn.Embedding`` or parameter whose attribute name is one of ``position_embedding_names``
(by default ``position_embeddings``, ``position_embedding``, ``pos_embedding``, ``pos_embed``, ``wpe``) is
zeroed and frozen, an embedding resized to ``max_sequence_length`` positions, as Composer does; a model that
adds positions another way must drop them itself.

Composer's arguments: ``max_sequence_length`` (the longest sequence the patched model accepts; longer keys
raise) and ``train_sequence_length_scaling``: at every ``Event.AFTER_DATALOADER`` of training, a dict batch
with ``input_ids`` of shape ``(N, S)`` is reshaped (every tensor shaped like ``input_ids``) into sequences of
``int(S * scaling)`` tokens (a remainder is dropped), so training uses shorter sequences than evaluation;
1.0 keeps batches as they are. The surgery fires once, at ``Event.INIT``; PyTorch's fused inference paths,
which would skip the bias, are turned off for the patched layers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.algorithms.seq_length_warmup import set_batch_sequence_length
from fabric.trainer.algorithms.transformer_paths import disable_fused_transformer_paths
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State
from fabric.trainer.surgery import SurgeryAlgorithm, replace_modules, share_tensors, update_params_in_optimizer

POSITION_EMBEDDING_NAMES = ("position_embeddings", "position_embedding", "pos_embedding", "pos_embed", "wpe")


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ``num_heads`` ALiBi slopes: ``2^(-8 k / H)`` for ``k = 1..H`` when ``H`` is a power of two; otherwise
    those of the largest power of two below ``H``, then every other slope of twice that power."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads={num_heads!r} must be a positive integer.")

    def geometric(count: int) -> list[float]:
        return [2.0 ** (-8.0 * k / count) for k in range(1, count + 1)]

    power = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(power) + geometric(2 * power)[0::2][: num_heads - power]
    return torch.tensor(slopes, dtype=torch.float64)


def alibi_bias(
    num_heads: int,
    query_length: int,
    key_length: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``(num_heads, query_length, key_length)`` additive bias ``-m_h * |i - j|``.

    Queries are the last ``query_length`` positions of the ``key_length`` keys (equal lengths by default).
    ``slopes``: :func:`alibi_slopes` of ``num_heads``, if already at hand (on ``device``).
    """
    key_length = query_length if key_length is None else key_length
    queries = torch.arange(key_length - query_length, key_length, device=device, dtype=torch.float64)
    keys = torch.arange(key_length, device=device, dtype=torch.float64)
    distance = (queries[:, None] - keys[None, :]).abs()
    slopes = alibi_slopes(num_heads).to(device) if slopes is None else slopes.to(device=device, dtype=torch.float64)
    return (-slopes[:, None, None] * distance).to(dtype)


class AlibiMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` that adds the ALiBi bias to its attention mask (see the module docstring)."""

    max_sequence_length: int = 8192

    @classmethod
    def from_attention(cls, attention: nn.MultiheadAttention, max_sequence_length: int) -> AlibiMultiheadAttention:
        """The ALiBi version of ``attention``, sharing its parameters (same state-dict keys)."""
        patched = cls(
            attention.embed_dim,
            attention.num_heads,
            dropout=attention.dropout,
            bias=attention.in_proj_bias is not None,
            add_bias_kv=attention.bias_k is not None,
            add_zero_attn=attention.add_zero_attn,
            kdim=attention.kdim,
            vdim=attention.vdim,
            batch_first=attention.batch_first,
            device="meta",
        )
        share_tensors(attention, patched)
        patched.out_proj = attention.out_proj
        patched.max_sequence_length = max_sequence_length
        # not in the state dict; follows the module across devices
        patched.register_buffer("slopes", alibi_slopes(attention.num_heads).to(attention.out_proj.weight.device), False)
        return patched

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = query.dim() == 3
        if batched and self.batch_first:  # F.multi_head_attention_forward takes (L, N, E)
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        mask = self.biased_mask(query, key, attn_mask, is_causal)
        if key_padding_mask is not None and key_padding_mask.dtype == torch.bool:  # same kind as ``mask``
            key_padding_mask = _additive(key_padding_mask, mask.dtype)
        separate = not self._qkv_same_embed_dim
        output, weights = F.multi_head_attention_forward(
            query,
            key,
            value,
            self.embed_dim,
            self.num_heads,
            self.in_proj_weight,
            self.in_proj_bias,
            self.bias_k,
            self.bias_v,
            self.add_zero_attn,
            self.dropout,
            self.out_proj.weight,
            self.out_proj.bias,
            training=self.training,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=mask,
            use_separate_proj_weight=separate,
            q_proj_weight=self.q_proj_weight if separate else None,
            k_proj_weight=self.k_proj_weight if separate else None,
            v_proj_weight=self.v_proj_weight if separate else None,
            average_attn_weights=average_attn_weights,
            is_causal=False,  # a causal mask, if asked for, is part of ``mask``
        )
        if batched and self.batch_first:
            output = output.transpose(0, 1)
        return output, weights

    def biased_mask(
        self, query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool
    ) -> torch.Tensor:
        """``attn_mask`` (made additive) plus the ALiBi bias, shaped ``(N * heads, L, S)`` (``(heads, L, S)``
        for unbatched inputs); ``query`` and ``key`` are ``(L, N, E)``/``(S, N, E)`` or unbatched."""
        query_length, key_length = query.shape[0], key.shape[0]
        if key_length > self.max_sequence_length:
            raise ValueError(
                f"Alibi: a sequence of {key_length} keys is longer than max_sequence_length={self.max_sequence_length}."
            )
        batch = query.shape[1] if query.dim() == 3 else 1
        dtype = query.dtype if query.is_floating_point() else torch.float32
        slopes = self.slopes if isinstance(self.slopes, torch.Tensor) else None
        bias = alibi_bias(self.num_heads, query_length, key_length, query.device, dtype, slopes)
        if attn_mask is None and is_causal:
            offset = key_length - query_length
            attn_mask = torch.ones(query_length, key_length, dtype=torch.bool, device=query.device).triu(1 + offset)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = _additive(attn_mask, dtype)
        per_head = bias.unsqueeze(0).expand(batch, -1, -1, -1).reshape(batch * self.num_heads, query_length, -1)
        if attn_mask is None:
            return per_head
        return per_head + attn_mask.to(dtype)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: masked out) as an additive one: ``-inf`` where masked, 0 elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def _check(max_sequence_length: int, train_sequence_length_scaling: float) -> None:
    if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, int) or max_sequence_length < 1:
        raise ValueError(f"Alibi: max_sequence_length={max_sequence_length!r} must be a positive integer.")
    scaling = train_sequence_length_scaling
    if isinstance(scaling, bool) or not isinstance(scaling, int | float) or not 0 < scaling <= 1:
        raise ValueError(f"Alibi: train_sequence_length_scaling={scaling!r} must be a fraction in (0, 1].")


def _is_cross_attention(model: nn.Module, name: str) -> bool:
    parent_name, _, attribute = name.rpartition(".")
    return attribute == "multihead_attn" and isinstance(model.get_submodule(parent_name), nn.TransformerDecoderLayer)


def apply_alibi(
    model: nn.Module,
    max_sequence_length: int = 8192,
    optimizers: Sequence[Optimizer] = (),
    position_embedding_names: Sequence[str] = POSITION_EMBEDDING_NAMES,
) -> list[str]:
    """Give ``model``'s self-attention ALiBi biases and drop its position embeddings, in place (see the module
    docstring); returns the names of the patched attention modules.

    Raises ``ValueError`` when ``model`` has no ``nn.MultiheadAttention`` (already patched ones are kept).
    """
    _check(max_sequence_length, 1.0)
    attention = [name for name, module in model.named_modules() if isinstance(module, nn.MultiheadAttention)]
    if not attention:
        present = sorted({type(module).__name__ for module in model.modules()})
        raise ValueError(
            "Alibi supports models whose attention is torch.nn.MultiheadAttention (alone or in "
            f"nn.TransformerEncoderLayer/DecoderLayer); {type(model).__name__} has none (its module classes are "
            f"{present})."
        )

    def patch(module: nn.Module, name: str) -> nn.Module | None:
        assert isinstance(module, nn.MultiheadAttention)
        if _is_cross_attention(model, name):
            return None
        return AlibiMultiheadAttention.from_attention(module, max_sequence_length)

    patched = list(replace_modules(model, {nn.MultiheadAttention: patch}, optimizers))
    disable_fused_transformer_paths(model)  # they would skip self_attn.forward, and so the bias
    _drop_position_embeddings(model, max_sequence_length, optimizers, position_embedding_names)
    return patched


def _drop_position_embeddings(
    model: nn.Module, max_sequence_length: int, optimizers: Sequence[Optimizer], names: Sequence[str]
) -> list[str]:
    """Zero and freeze the position embeddings named ``names`` (embeddings get ``max_sequence_length`` rows)."""
    dropped = []
    for owner_name, owner in list(model.named_modules()):
        for attribute in names:
            found = getattr(owner, attribute, None)
            qualified = f"{owner_name}.{attribute}" if owner_name else attribute
            if isinstance(found, nn.Embedding):
                like = {"device": found.weight.device, "dtype": found.weight.dtype}
                frozen = nn.Embedding(max_sequence_length, found.embedding_dim, **like)  # type: ignore[arg-type]
                nn.init.zeros_(frozen.weight)
                frozen.weight.requires_grad_(False)
                update_params_in_optimizer(list(found.parameters()), [], optimizers)
                owner.register_module(attribute, frozen)
                dropped.append(qualified)
            elif isinstance(found, nn.Parameter) and (found.requires_grad or bool(found.detach().any())):
                with torch.no_grad():
                    found.zero_()
                found.requires_grad_(False)
                update_params_in_optimizer([found], [], optimizers)
                dropped.append(qualified)
    return dropped


class Alibi(SurgeryAlgorithm):
    """ALiBi attention in place of position embeddings (see the module docstring)."""

    def __init__(
        self,
        max_sequence_length: int = 8192,
        train_sequence_length_scaling: float = 0.25,
        position_embedding_names: Sequence[str] = POSITION_EMBEDDING_NAMES,
    ) -> None:
        _check(max_sequence_length, train_sequence_length_scaling)
        if isinstance(position_embedding_names, str) or not all(
            isinstance(name, str) and name.isidentifier() for name in position_embedding_names
        ):
            raise ValueError(
                f"Alibi: position_embedding_names={position_embedding_names!r} must be a sequence of attribute names."
            )
        self.max_sequence_length = max_sequence_length
        self.train_sequence_length_scaling = train_sequence_length_scaling
        self.position_embedding_names = list(position_embedding_names)
        self._warned = False

    @override
    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT or (event == Event.AFTER_DATALOADER and self.train_sequence_length_scaling != 1)

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            super().apply(event, state, logger)
            return
        batch = state.batch
        if not (isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor)):
            if not self._warned:
                warnings.warn(
                    "Alibi: train_sequence_length_scaling shortens dict batches with an 'input_ids' tensor; this "
                    f"batch ({type(batch).__name__}) is left as it is.",
                    stacklevel=2,
                )
                self._warned = True
            return
        length = int(batch["input_ids"].shape[1] * self.train_sequence_length_scaling)
        if length >= 1:
            state.batch = set_batch_sequence_length(batch, length, truncate=False)

    @override
    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        apply_alibi(model, self.max_sequence_length, optimizers, self.position_embedding_names)

    @override
    def hparams(self) -> dict[str, Any]:
        return {
            "max_sequence_length": self.max_sequence_length,
            "train_sequence_length_scaling": self.train_sequence_length_scaling,
            "position_embedding_names": list(self.position_embedding_names),
        }
