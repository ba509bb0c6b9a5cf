"""Model definitions: one Llama-family decoder covers Llama 2/3, Mistral, Qwen2/2.5 and Qwen3."""

from engine.models.llama import LlamaFamilyForCausalLM

__all__ = ["LlamaFamilyForCausalLM"]
