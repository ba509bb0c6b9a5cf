"""Building blocks of a Llama-family decoder, numerically matched to Hugging Face's.

Inside a decoder layer the submodules' `forward` is called directly, not through `nn.Module.__call__`:
nothing registers hooks on them, and on a CPU at batch 1 the calls' bookkeeping was a visible part of
a decode step (`benchmarks/engine_host.py`); the model itself is still called as a module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

import kernels
from kernels import cpu_linear
from engine.config import RopeScaling


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one engine step, built once by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot per new token, -1 = skip
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with -1
    context_lens: torch.Tensor  # [num_seqs] int32, tokens in cache including the new ones
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int


class Linear(nn.Linear):
    """`nn.Linear` whose product runs over a prepacked copy of its weight once `prepack` made one
    (`kernels.cpu_linear`: bf16 on a CPU); the same values as without it."""

    packed: torch.Tensor | None = None

    def prepack(self) -> None:
        """Packs the weight where `kernels.cpu_linear` can; call again after the weight changes."""
        self.packed = cpu_linear.pack(self.weight) if cpu_linear.can_pack(self.weight) else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return super().forward(hidden)
        return cpu_linear.linear(hidden, self.packed, self.bias)


def prepack_linears(model: nn.Module) -> int:
    """Prepacks every `Linear` of `model` that `kernels.cpu_linear` can pack; how many it packed."""
    layers = [module for module in model.modules() if isinstance(module, Linear)]
    for layer in layers:
        layer.prepack()
    return sum(layer.packed is not None for layer in layers)


class MergedLinear(Linear):
    """Several projections of the same input as one matrix product: their weights stacked by output row.

    Checkpoints keep the parts apart (Hugging Face's `q_proj`, `k_proj`, `v_proj`, siblings of this module);
    the loader stacks them in `parts` order, so one launch replaces several small ones on every layer.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)  # checkpoint name of each part -> its output features, in stacking order
        self.part_sizes = list(self.parts.values())

    def split_forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each part's output, as views of the one product."""
        return self.forward(hidden).split_with_sizes(self.part_sizes, dim=-1)  # (`Tensor.split` adds Python)

    def checkpoint_shapes(self, module_name: str, param_name: str) -> dict[str, tuple[int, ...]]:
        """The checkpoint's names and shapes for this module's `param_name` ("weight" or "bias"), in order."""
        parent = module_name.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        rest = tuple(getattr(self, param_name).shape[1:])
        return {f"{prefix}{part}.{param_name}": (size, *rest) for part, size in self.parts.items()}


class RMSNorm(nn.Module):
    """RMSNorm through `kernels` (one fused launch on CUDA), rounded as the reference models round it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(hidden, self.weight, self.eps)

    def add_and_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + hidden, residual + hidden): the decoder's residual add fused into the norm."""
        return kernels.add_rms_norm(hidden, residual, self.weight, self.eps)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with precomputed cos/sin caches [max_positions, head_dim / 2] indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.rotary_embedding(positions, query, key, self.cos_cache, self.sin_cache)


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        output_bias: bool,
        qk_norm_eps: float | None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.qkv_proj = MergedLinear(
            hidden_size,
            {"q_proj": num_heads * head_dim, "k_proj": num_kv_heads * head_dim, "v_proj": num_kv_heads * head_dim},
            bias=bias,
        )
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=output_bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        query, key, value = self.qkv_proj.split_forward(hidden)
        query = query.view(tokens, self.num_heads, self.head_dim)
        key = key.view(tokens, self.num_kv_heads, self.head_dim)
        value = value.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = rotary.forward(positions, query, key)
        kernels.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        output = kernels.paged_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.cu_seqlens_q,
            meta.max_seqlen_q,
            self.scale,
        )
        return self.o_proj.forward(output.reshape(tokens, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """SiLU-gated: the config check refuses any other activation."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(kernels.silu_and_mul(self.gate_up_proj.forward(hidden)))
