"""fusec's built-in models: GPT-2, BERT, Llama and Qwen3 graphs in the form HF exports them.

    import fusec.models
    fusec.models.names()                      # ['gpt2-tiny', 'gpt2-small', ...]
    g = fusec.models.build("gpt2-tiny", {"input_ids": (2, 16), "attention_mask": (2, 16)})
"""

from __future__ import annotations

from .registry import ModelConfig, build, get_config, names

__all__ = ["ModelConfig", "build", "get_config", "names"]
