"""Small MindSpore cells shared by tests and workers: a weighted NLL loss net and a cell that applies gradients."""
from mindspore import nn, ops


class WeightedNLLLoss(nn.Cell):
    """Negative log-likelihood of the labels summed under per-token weights (this rank's token-mean when the
    weights are the mask over this rank's token count: the sum over micro-batches is the batch's loss)."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, labels, mask, weights):
        loss = -(self.model.log_probs(input_ids, labels, mask) * weights).sum()
        return loss, ops.stop_gradient(loss)


class ApplyGrads(nn.Cell):
    def __init__(self, optimizer):
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer

    def construct(self, grads, scale):
        return self.optimizer(grads, scale)
