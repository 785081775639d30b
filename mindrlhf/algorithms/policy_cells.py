"""Cells between a causal LM and the losses: response log-probs, the GRPO loss net and the SFT loss.

Shapes are static: prompts are left-padded to a bucket width P and responses padded to R, so each cell
compiles once per (prompts, responses, P, R). The cells take prompts [Bg, P] and responses [Bg K, R]: the K
responses j K .. j K + K - 1 share prompt j, which is read once for all of them (prefix sharing,
`mindrlhf.models.qwen2.modeling.response_sequences`); K = 1 is one prompt per response.

Each cell names its tensor arguments in construct order, `hidden_in` excluded, in `INPUTS` (experience columns,
and `token_weights`, the aggregation's weights of the mini-batch); each loss net names its outputs in `OUTPUTS`,
without a role prefix (the trainer adds `actor/` or `critic/` to its metrics).
"""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from mindrlhf.algorithms.loss_cell import GRPOLossCell
from mindrlhf.algorithms.value_loss_cell import ValueLossCell


class ResponseLogProbs(nn.Cell):
    """log p(response token t | prompt, response[:t]) for every response position, float32 [B, R].

    Wraps a causal LM exposing `response_log_probs` (Qwen2ForCausalLM); `temperature` must be the sampling
    temperature (the generator reports log-probs of softmax(logits / T) too). Only the response positions go
    through the head. Positions after a response's end are computed but meaningless: mask them with the response
    mask.
    """

    INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")

    def __init__(self, model: nn.Cell, temperature: float = 1.0, with_entropy: bool = False):
        super().__init__(auto_prefix=False)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for log-probs (greedy sampling scores at 1.0), "
                             f"got {temperature}")
        self.model = model
        self.temperature = float(temperature)
        self.with_entropy = with_entropy

    def construct(self, prompt_ids, prompt_mask, response_ids, response_mask, hidden_in=None):
        return self.model.response_log_probs(prompt_ids, prompt_mask, response_ids, response_mask, self.temperature,
                                             self.with_entropy, hidden_in)


class ResponseHidden(nn.Cell):
    """A pipeline stage before the last on the positions `ResponseLogProbs` reads: its output [Bg, P + K (R - 1),
    D], from the prompt and response tokens (first stage) or from `hidden_in`, the previous stage's output. Wraps a
    causal LM or a value model (anything whose `model` is a `Qwen2Model`)."""

    INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, prompt_ids, prompt_mask, response_ids, response_mask, hidden_in=None):
        return self.model.model.read_responses(prompt_ids, prompt_mask, response_ids, response_mask, True, hidden_in)


def response_hidden_shape(hidden_size: int):
    """The shape of `ResponseHidden`'s output for a micro-batch (prompt ids [Bg, P], prompt mask, response ids
    [Bg K, R], ...): [Bg, P + K (R - 1), hidden_size], what a pipeline stage receives
    (`PipelineTrainStep(hidden_shape=)`)."""
    def shape(inputs):
        (groups, prompt_width), (rows, response_width) = inputs[0].shape, inputs[2].shape
        return groups, prompt_width + rows // groups * (response_width - 1), hidden_size
    return shape


def response_values_shape(inputs):
    """The shape of `ResponseValues`' output for a micro-batch (prompt ids, prompt mask, response ids, ...)."""
    return inputs[2].shape


class ResponseValues(nn.Cell):
    """The critic's value of the state before each response token, float32 [B, R]: the positions whose
    log-probs `ResponseLogProbs` returns (verl's `values[:, -response_length - 1:-1]`). Wraps a
    `Qwen2ForValue`."""

    INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, prompt_ids, prompt_mask, response_ids, response_mask, hidden_in=None):
        return self.model.response_values(prompt_ids, prompt_mask, response_ids, response_mask, True, hidden_in)


class ResponseScores(nn.Cell):
    """A reward model's score of each (prompt, response), float32 [B]: a `Qwen2ForValue`'s output at the last
    response token (right-padded responses; HF's `*ForSequenceClassification` reads the last non-pad token)."""

    INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, prompt_ids, prompt_mask, response_ids, response_mask):
        values = self.model.response_values(prompt_ids, prompt_mask, response_ids, response_mask, False)
        mask = response_mask.astype(ms.float32)
        following = ops.concat((mask[:, 1:], ops.zeros_like(mask[:, :1])), 1)
        return (values * (mask - following)).sum(axis=1)  # 1 at the last response token only


class ValueLossNet(nn.Cell):
    """The critic's values of the sampled responses fed to the clipped value loss (`ValueLossCell`); returns
    `OUTPUTS` `(vf_loss, vf_clipfrac)`, this rank's shares under the token weights. The experience column `values`
    (the critic's values when the responses were scored) is the construct argument `old_values`."""

    INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "values", "returns", "token_weights")
    OUTPUTS = ValueLossCell.OUTPUTS

    def __init__(self, model: nn.Cell, loss_cell: nn.Cell):
        super().__init__(auto_prefix=False)
        self.response_values = ResponseValues(model)
        self.loss_cell = loss_cell

    def construct(self, prompt_ids, prompt_mask, response_ids, response_mask, old_values, returns, token_weights,
                  hidden_in=None):
        values = self.response_values(prompt_ids, prompt_mask, response_ids, response_mask, hidden_in)
        return self.loss_cell(values, old_values, returns, response_mask, token_weights)


class GRPOLossNet(nn.Cell):
    """Policy log-probs of the sampled responses fed to the GRPO loss cell.

    Returns `OUTPUTS`: the loss cell's outputs and the token-weighted entropy of the policy
    (softmax(logits / T) over the whole vocabulary), each this rank's share under the token weights.
    """

    INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "old_logp", "ref_logp", "advantages",
              "token_weights")
    OUTPUTS = GRPOLossCell.OUTPUTS + ("entropy",)

    def __init__(self, model: nn.Cell, loss_cell: nn.Cell, temperature: float = 1.0):
        super().__init__(auto_prefix=False)
        self.response_log_probs = ResponseLogProbs(model, temperature, with_entropy=True)
        self.loss_cell = loss_cell
        self.OUTPUTS = loss_cell.OUTPUTS + ("entropy",)
        if not loss_cell.with_kl:  # the loss reads no reference log-probs: a job without a reference has none
            self.INPUTS = tuple("old_logp" if name == "ref_logp" else name for name in self.INPUTS)

    def construct(self, prompt_ids, prompt_mask, response_ids, response_mask, old_logp, ref_logp, advantages,
                  token_weights, hidden_in=None):
        logp, entropy = self.response_log_probs(prompt_ids, prompt_mask, response_ids, response_mask, hidden_in)
        outputs = self.loss_cell(logp, old_logp, ref_logp, advantages, response_mask, token_weights)
        weights = token_weights.astype(ms.float32) * response_mask.astype(ms.float32)
        return outputs + (ops.stop_gradient((weights * entropy).sum()),)


PACKED_COLUMNS = ("response_ids", "response_mask", "position_ids", "segment_ids")


class PackedLogProbs(nn.Cell):
    """log p(token t | its sample's tokens before it) [B, S] of packed rows (a row's samples are its response, with
    no prompt: `mindrlhf.data.stage_data.PackedSFTDataset`); a sample's first position is meaningless (mask it)."""

    INPUTS = PACKED_COLUMNS

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, response_ids, response_mask, position_ids, segment_ids):
        # the segment ids mark the padding: response_mask is taken for the engines' column order only
        return self.model.packed_log_probs(response_ids, position_ids, segment_ids)


class PackedSFTLossNet(nn.Cell):
    """`SFTLossNet` on packed rows: the weighted negative log-likelihood of the trained tokens, as (loss,)."""

    INPUTS = (*PACKED_COLUMNS, "token_weights")
    OUTPUTS = ("loss",)

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)
        self.log_probs = PackedLogProbs(model)

    def construct(self, response_ids, response_mask, position_ids, segment_ids, token_weights):
        logp = self.log_probs(response_ids, response_mask, position_ids, segment_ids)
        return (-(logp * token_weights.astype(ms.float32)).sum(),)


class SFTLossNet(nn.Cell):
    """Supervised fine-tuning: the negative log-likelihood of the response tokens weighted by `token_weights` (the
    update's aggregation of the trained tokens, `loss_mask`: a rank's share of the update's token-mean), as (loss,)."""

    INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "token_weights")
    OUTPUTS = ("loss",)

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)
        self.response_log_probs = ResponseLogProbs(model)

    def construct(self, prompt_ids, prompt_mask, response_ids, response_mask, token_weights, hidden_in=None):
        logp = self.response_log_probs(prompt_ids, prompt_mask, response_ids, response_mask, hidden_in)
        loss = -(logp * token_weights.astype(ms.float32)).sum()
        return (loss,)
