"""The Llama-family decoder. Parameter names mirror Hugging Face's so checkpoints load as they are."""

from __future__ import annotations

import torch
from torch import nn

import kernels
from kernels import cpu_decode

from engine.config import ModelConfig
from engine.models.layers import Attention, AttentionMetadata, GatedMLP, Linear, RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            bias=config.attention_bias,
            output_bias=config.output_bias,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions, hidden, residual: torch.Tensor | None, rotary, k_cache, v_cache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added): each add is fused into the next norm."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn.forward(positions, hidden, rotary, k_cache, v_cache, meta)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp.forward(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaFamilyForCausalLM(nn.Module):
    """Runs flattened tokens of many sequences at once against a paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self._decode_plan: cpu_decode.DecodePlan | None | bool = False  # False: not made yet (`_native_plan`)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's own signature)
        # `.to()`, `.bfloat16()` and the like replace the tensors the compiled decode's plan points into.
        self._decode_plan = False
        return super()._apply(fn, recurse)

    def _native_plan(self) -> cpu_decode.DecodePlan | None:
        """The compiled CPU decode's view of this model's weights, made on first use; None where it cannot
        read them (then every decode runs eagerly)."""
        if self._decode_plan is False:
            self._decode_plan = cpu_decode.plan_for(self)
        return self._decode_plan  # type: ignore[return-value]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, hidden]; `compute_logits` projects the rows that sample."""
        plan = self._covering_plan(input_ids, positions, kv_cache, meta)
        if plan is not None:  # one sequence's one new token on a CPU: the compiled forward, all layers at once
            return cpu_decode.forward(plan, self.model.embed_tokens(input_ids), kv_cache, meta.block_tables,
                                      meta.context_lens, positions, meta.slot_mapping, meta.cu_seqlens_q)
        hidden, residual = self.model.embed_tokens(input_ids), None
        rotary = self.rotary
        with kernels.one_forward():  # the layers share their metadata's checks, attention plan and rotary rows
            # (`forward` called directly: see `engine.models.layers`)
            caches = kv_cache.unbind(0)  # every layer's K and V views in one call
            for index, layer in enumerate(self.model.layers):
                hidden, residual = layer.forward(
                    positions, hidden, residual, rotary, caches[2 * index], caches[2 * index + 1], meta
                )
        if residual is None:  # a model without layers
            return self.model.norm(hidden)
        return self.model.norm.add_and_norm(hidden, residual)[0]

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor | None:
        """`compute_logits(forward(...))` [1, vocab] of a step that is one sequence's one new token, where the
        compiled CPU decode runs it: the layers and the output head in one call (one parallel region, no
        hidden state handed back through Python), the same values. None elsewhere, having run nothing: then
        `forward` and `compute_logits`."""
        plan = self._covering_plan(input_ids, positions, kv_cache, meta)
        if plan is None or plan.head is None:
            return None
        return cpu_decode.forward(plan, self.model.embed_tokens(input_ids), kv_cache, meta.block_tables,
                                  meta.context_lens, positions, meta.slot_mapping, meta.cu_seqlens_q, logits=True)

    def _covering_plan(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata) -> cpu_decode.DecodePlan | None:
        """The compiled decode's plan where it runs this step (`cpu_decode.covers`), else None."""
        if kernels.runs_native_decode(input_ids.device) and cpu_decode.covers(
                input_ids, kv_cache, meta.block_tables, meta.context_lens, positions, meta.slot_mapping,
                meta.cu_seqlens_q):
            return self._native_plan()
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        if (hidden.shape[0] == 1 and kernels.runs_native_decode(hidden.device)
                and cpu_decode.can_project(hidden, head.weight, head.bias)):
            return cpu_decode.project(hidden, head.weight, head.bias).float()  # batch-1 decode's output head
        return head(hidden).float()
