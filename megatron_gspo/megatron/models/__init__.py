"""Model building: Megatron-Core's GPTModel from a Hugging Face `config.json`.

builder (the architectures, TransformerConfig and layer spec, vocabulary padding), one module per
family with its own mapping (deepseek_v3, glm4_moe, gemma3 with gemma_layers, gpt_oss), the local
(no Transformer Engine) layers of the spec (local_layers), full <-> sharded tensors in Megatron
parameter naming (weights), transformers' `padding_idx` on the embedding (padding_idx), and what
Transformer Engine asserts only on a GPU (te_conditions).
"""
