"""A random `Experience` (a rollout's columns) for tests of what consumes one."""
import numpy as np

from mindrlhf.data.experience import Experience


def make_experience(rows, prompt_width, response_width, seed=0, pad=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, prompt_width + 1, rows)
    prompt_mask = (np.arange(prompt_width)[None, :] >= prompt_width - lengths[:, None]).astype(np.int32)
    prompt_ids = np.where(prompt_mask > 0, rng.integers(1, 150000, (rows, prompt_width)), pad).astype(np.int32)
    response_mask = (np.arange(response_width)[None, :] < rng.integers(1, response_width + 1, rows)[:, None])
    token_values = rng.standard_normal((rows, response_width)).astype(np.float32)
    return Experience({
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "response_ids": rng.integers(0, 150000, (rows, response_width)).astype(np.int32),
        "response_mask": response_mask.astype(np.int32),
        "old_logp": rng.standard_normal((rows, response_width)).astype(np.float32),
        "ref_logp": rng.standard_normal((rows, response_width)).astype(np.float32),
        "rewards": rng.random(rows).astype(np.float32), "advantages": token_values,
        "reward/accuracy": rng.random(rows).astype(np.float32)})


def with_critic_columns(exp):
    rng = np.random.default_rng(1)
    shape = exp.response_mask.shape
    return exp.with_columns(values=rng.standard_normal(shape).astype(np.float32),
                            returns=rng.standard_normal(shape).astype(np.float32))
