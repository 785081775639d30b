"""Roles on `TrainEngine`s whose train step is a stand-in (no net is built): the engines' update loop and the
trainer's metric code run on them."""
from types import SimpleNamespace

import numpy as np

from mindrlhf.configs.grpo_configs import GRPOConfig
from mindrlhf.engine.step_shape import StepShape
from mindrlhf.engine.train import TrainEngine
from mindrlhf.parallel.layout import Layout
from mindrlhf.trainer.roles import update_policy


class FakeLossNet:
    """What an engine reads of a loss net: its columns and output names."""

    def __init__(self, inputs, outputs):
        self.INPUTS, self.OUTPUTS = inputs, outputs


ACTOR_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "old_logp", "ref_logp", "advantages",
                "token_weights")
CRITIC_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "values", "returns",
                 "token_weights")


def fake_engine(name, norms, max_consecutive_skips, inputs, outputs, seen=None):
    """A `TrainEngine` whose train step returns the next of `norms` (NaN = a skipped update) and loss shares of 1,
    on one rank of a step of 4 prompts x 2 responses, one prompt an update; `seen` collects the inputs of each
    step."""
    config = GRPOConfig().replace({"optimizer": {"max_consecutive_skips": max_consecutive_skips},
                                   "schedule": {"batch_size": 4, "mini_batch_size": 1, "steps": 10},
                                   "generation": {"num_generations": 2}})
    engine = TrainEngine.__new__(TrainEngine)
    engine.name, engine.loss_net, engine.layout = name, FakeLossNet(inputs, outputs), Layout()
    engine.shape = StepShape.of(config.schedule, config.generation.num_generations, 1, 1)
    engine.optimizer = SimpleNamespace(set_learning_rate=lambda lr: None)
    engine.sizer = SimpleNamespace(width=lambda mask, longest=None: mask.shape[1],
                                   split=lambda columns, width, first_row, names: [[columns[n] for n in names]])
    engine.comm = SimpleNamespace(group_sum=lambda values, group: values)
    engine.policy = update_policy(config.optimizer, config.schedule, engine.shape, config.loss.aggregation, 1e-3, 0,
                                  1.0)
    calls = iter(norms)

    def train_step(micro_batches):
        if seen is not None:
            seen.append(micro_batches[0])
        norm = next(calls)
        return np.full(len(outputs), np.nan if not np.isfinite(norm) else 1.0), norm

    engine.step, engine.updates, engine.consecutive_skips = train_step, 0, 0
    return config, engine


def role_with_engine(role_class, name, norms, max_consecutive_skips, inputs, outputs, seen=None):
    config, engine = fake_engine(name, norms, max_consecutive_skips, inputs, outputs, seen)
    role = role_class.__new__(role_class)
    role.spec = SimpleNamespace(schedule=config.schedule, shape=engine.shape)
    role.engine = engine
    return role
