"""Small fixed batches shared by tests and workers."""
import numpy as np


def grpo_batch(vocab_size: int) -> dict[str, np.ndarray]:
    """A global batch of 4 responses; the first two (dp rank 0's) are much longer than the last two."""
    rng = np.random.RandomState(2)
    batch, prompt_len, response_len = 4, 6, 10
    prompt_mask = np.ones((batch, prompt_len), np.int32)
    prompt_mask[2, :2] = 0
    response_mask = np.zeros((batch, response_len), np.int32)
    for row, length in enumerate((10, 8, 3, 1)):
        response_mask[row, :length] = 1
    return {"prompt_ids": rng.randint(0, vocab_size, (batch, prompt_len)).astype(np.int32),
            "prompt_mask": prompt_mask,
            "response_ids": rng.randint(0, vocab_size, (batch, response_len)).astype(np.int32),
            "response_mask": response_mask,
            "advantages": rng.randn(batch).astype(np.float32),
            "noise": rng.randn(2, batch, response_len).astype(np.float32)}
