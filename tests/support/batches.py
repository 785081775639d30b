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


def grpo_train_inputs(rng: np.random.Generator, vocab_size: int, prompts: int, rows: int, prompt_width: int,
                      response_width: int) -> list[np.ndarray]:
    """One GRPO train graph call's inputs (`support.cells.grpo_train_step`): `prompts` prompts read by `rows`
    responses of random tokens, every position real, old and reference log-probs -1, normal advantages, token-mean
    weights."""
    return [rng.integers(1, vocab_size, (prompts, prompt_width)).astype(np.int32),
            np.ones((prompts, prompt_width), np.int32),
            rng.integers(1, vocab_size, (rows, response_width)).astype(np.int32),
            np.ones((rows, response_width), np.int32),
            np.full((rows, response_width), -1.0, np.float32), np.full((rows, response_width), -1.0, np.float32),
            rng.standard_normal(rows).astype(np.float32),
            np.full((rows, response_width), 1.0 / (rows * response_width), np.float32)]
