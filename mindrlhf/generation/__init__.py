"""Batched sampling with a static KV cache: prefill + decode graphs compiled once per shape bucket.

Its settings, `GenerationConfig`, live in `mindrlhf.configs.generation` (re-exported here)."""
from mindrlhf.configs.generation import GenerationConfig
from mindrlhf.generation.generator import GenerationOutput, Generator
from mindrlhf.generation.sampling import (
                                          greedy_tokens,
                                          nucleus_mask,
                                          sample_tokens,
                                          token_log_probs,
                                          top_k_candidates,
                                          top_k_filter,
                                          top_p_filter,
)

__all__ = ["GenerationConfig", "GenerationOutput", "Generator", "greedy_tokens", "nucleus_mask", "sample_tokens",
           "token_log_probs", "top_k_candidates", "top_k_filter", "top_p_filter"]
