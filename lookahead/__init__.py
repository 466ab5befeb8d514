"""Lookahead decoding for Llama-family models: several tokens per forward pass, output exactly the model's.

    import lookahead
    model, tokenizer = lookahead.load_default()
    out = model.generate(input_ids, max_new_tokens=128, lookahead=lookahead.LookaheadConfig())
"""

from .config import LookaheadConfig
from .loading import load_default, load_tokenizer
from .memory import DraftMemory
from .model import KVCache, LlamaForCausalLM, ModelConfig
from .outputs import GenerateOutput, GenerationStats, StepTrace
from .prompt_cache import PromptCache
from .scoring import CausalLMOutput

__all__ = ["LookaheadConfig", "LlamaForCausalLM", "ModelConfig", "KVCache", "load_default", "load_tokenizer",
           "GenerateOutput", "GenerationStats", "StepTrace", "CausalLMOutput", "PromptCache",
           "DraftMemory"]
