"""Cells between a causal LM and the losses: response log-probs, the GRPO loss net and the SFT loss.

Shapes are static: prompts are left-padded to a bucket width P and responses padded to R, so each cell
compiles once per (batch, P, R).
"""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops


class ResponseLogProbs(nn.Cell):
    """log p(response token t | prompt, response[:t]) for every response position, float32 [B, R].

    Wraps a causal LM exposing `log_probs(input_ids, labels, attention_mask, temperature)`
    (Qwen2ForCausalLM); `temperature` must be the sampling temperature (the generator reports
    log-probs of softmax(logits / T) too). Positions after a response's end are computed but
    meaningless: mask them with the response mask.
    """

    def __init__(self, model: nn.Cell, temperature: float = 1.0):
        super().__init__(auto_prefix=False)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for log-probs (greedy sampling scores at 1.0), got {temperature}")
        self.model = model
        self.temperature = float(temperature)

    def construct(self, prompt_ids, prompt_mask, response_ids, response_mask):
        prompt_width = prompt_ids.shape[1]
        response_width = response_ids.shape[1]
        input_ids = ops.concat((prompt_ids, response_ids), 1)
        attention_mask = ops.concat((prompt_mask.astype(ms.int32), response_mask.astype(ms.int32)), 1)
        labels = ops.concat((input_ids[:, 1:], ops.zeros((input_ids.shape[0], 1), input_ids.dtype)), 1)
        logp = self.model.log_probs(input_ids, labels, attention_mask, self.temperature)
        return logp[:, prompt_width - 1:prompt_width - 1 + response_width]


class GRPOLossNet(nn.Cell):
    """Policy log-probs of the sampled responses fed to the GRPO loss cell; returns (loss, *stats)."""

    def __init__(self, model: nn.Cell, loss_cell: nn.Cell, temperature: float = 1.0):
        super().__init__(auto_prefix=False)
        self.response_log_probs = ResponseLogProbs(model, temperature)
        self.loss_cell = loss_cell

    def construct(self, prompt_ids, prompt_mask, response_ids, response_mask, old_logp, ref_logp, advantages):
        logp = self.response_log_probs(prompt_ids, prompt_mask, response_ids, response_mask)
        return self.loss_cell(logp, old_logp, ref_logp, advantages, response_mask)


class ResponseNLLLoss(nn.Cell):
    """Supervised fine-tuning loss: token-mean negative log-likelihood of the responses, as (loss, loss)."""

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)
        self.response_log_probs = ResponseLogProbs(model)

    def construct(self, prompt_ids, prompt_mask, response_ids, response_mask):
        logp = self.response_log_probs(prompt_ids, prompt_mask, response_ids, response_mask)
        mask = response_mask.astype(ms.float32)
        loss = -(logp * mask).sum() / ops.maximum(mask.sum(), 1.0)
        return loss, ops.stop_gradient(loss)
