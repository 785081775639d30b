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


def grpo_train_step(model, temperature: float = 1.0):
    """A GRPO train step on one process (the trainer's cells: GRPO loss, micro-batched step, AdamW, clip 1.0), called
    as `step([inputs])` with `support.batches.grpo_train_inputs` as tensors."""
    from mindrlhf.algorithms import GRPOLossCell
    from mindrlhf.algorithms.policy_cells import GRPOLossNet
    from mindrlhf.optim import AdamW
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.parallel.spmd import MicroBatchedTrainStep

    loss_net = GRPOLossNet(model, GRPOLossCell(beta=0.01, epsilon_low=0.2, epsilon_high=0.28), temperature)
    return MicroBatchedTrainStep(loss_net, AdamW(model.trainable_params(), learning_rate=1e-6), Layout(),
                                 grad_reduction="sum", max_grad_norm=1.0)
