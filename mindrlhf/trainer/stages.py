"""The stages before RL, each what `StageTrainer` needs of it: its data, net, loss, the role that checkpoints it, and
its held-out score.

    sft     a causal LM on conversations, the token-mean loss of the assistant's tokens; eval/loss
    reward  a reward model (a `Qwen2ForValue`, the PPO critic's net) on preference pairs, Bradley-Terry; eval/accuracy
    dpo     a causal LM on preference pairs, DPO / IPO against the starting policy's log-probs; eval/accuracy
"""
from __future__ import annotations

import logging
import time

import numpy as np

from mindrlhf.algorithms.policy_cells import (
    PackedLogProbs,
    PackedSFTLossNet,
    ResponseLogProbs,
    ResponseScores,
    SFTLossNet,
)
from mindrlhf.algorithms.preference_cells import DPOLossNet, PairwiseRewardLoss
from mindrlhf.checkpoint.step import CRITIC_CKPT, CRITIC_PREFIX, CRITIC_STRATEGY, TRAIN_CKPT, TRAIN_STRATEGY
from mindrlhf.checkpoint.weights import (
    load_value_model,
    random_start,
    start_from,
    value_model_start,
)
from mindrlhf.data.stage_data import PackedSFTDataset, PairDataset, SFTDataset
from mindrlhf.models.qwen2 import Qwen2ForCausalLM, Qwen2ForValue
from mindrlhf.trainer.roles import Role

logger = logging.getLogger("mindrlhf.trainer")


class StageRole(Role):
    """The net a stage trains, in its engine; a policy is named `actor` and a reward model `critic`, so that a step
    folder of either loads where the RL job takes that net (`--load_sft_checkpoint_train`, `--load_critic_checkpoint`,
    `reward.reward_model_path`)."""

    def __init__(self, name: str, engine, files: tuple[str, str]):
        self.name, self.engine, self.files = name, engine, files

    def rank_files(self) -> dict[str, list]:
        return {self.files[0]: self.engine.weights() + self.engine.optimizer_state()}

    def shared_files(self) -> dict[str, tuple[dict, dict | None]]:
        return self.engine.strategy_file(self.files[1])

    def state_dict(self) -> dict:
        return {"engine": self.engine.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state["engine"])


class Stage:
    """One stage: `name` (the metrics' prefix), its dataset class, rows per record (`group_size`: a pair's two
    answers stay in one call), how its loss weighs tokens, its role's name and files, and the headline of its
    held-out score (`summary`: the last line says `<summary>: before=.. after=..`); `prefix`: its net's parameter
    names' (the critic's for a reward model)."""

    name = ""
    dataset_class = SFTDataset
    group_size = 1
    aggregation, token_mask = "seq-mean-token-mean", "response_mask"
    role_name, role_files, prefix = "actor", (TRAIN_CKPT, TRAIN_STRATEGY), ""
    summary, eval_key, percent = "", "", False

    def open_dataset(self, path: str, pad_token_id: int, seed: int, eval_fraction: float, eval_path: str):
        """The stage's records of `path` (and of `eval_path`, or a held-out share of `path`'s)."""
        return self.dataset_class(path, pad_token_id, seed, eval_fraction, eval_path)

    def data_note(self, dataset) -> str:
        """A line about how the data is laid out, logged when the stage starts ("" for none)."""
        del dataset
        return ""

    def build_net(self, cfg, layout):
        return Qwen2ForCausalLM(cfg, layout)

    def load(self, net, layout, checkpoint: str, seed: int) -> None:
        """The start: `checkpoint` (a policy's weights), or random weights of `seed`; LoRA adapters, if any, as
        PEFT starts them (seeded by `seed`)."""
        start_from(net, layout, checkpoint, seed)

    def loss_net(self, net, config):
        raise NotImplementedError

    def scorer(self, net):
        """The forward cell the held-out score (and any per-row values computed before training) reads."""
        return ResponseLogProbs(net)

    def prepare(self, trainer) -> None:
        """What the stage computes once, before its first step (DPO: the reference's log-probs)."""

    def loop_state(self, dataset) -> dict:
        return {}

    def load_loop_state(self, dataset, state: dict) -> None:
        del dataset, state

    def score(self, outputs: np.ndarray, rows) -> np.ndarray:
        """This rank's sums of the held-out score over `rows` (the scorer's `outputs`): (numerator, denominator)."""
        raise NotImplementedError

    def metric_names(self, metrics: dict) -> dict:
        """The engine's `<name>/<output>` metrics under the names users know them by (DPO: TRL's)."""
        return metrics


class SFTStage(Stage):
    """Token-mean cross-entropy of the assistant's tokens; with `sft.packing` on packed rows (`PackedSFTDataset`)."""

    name, summary, eval_key = "sft", "held-out loss", "eval/loss"
    aggregation, token_mask = "token-mean", "loss_mask"

    def __init__(self, config):
        self.config = config.sft

    def open_dataset(self, path, pad_token_id, seed, eval_fraction, eval_path):
        if not self.config.packing:
            return super().open_dataset(path, pad_token_id, seed, eval_fraction, eval_path)
        return PackedSFTDataset(path, pad_token_id, seed, eval_fraction, eval_path, self.config.max_length)

    def data_note(self, dataset) -> str:
        if not self.config.packing:
            return ""
        packed, unpacked = dataset.padding_shares()
        effect = (f"{100 * (1 - packed / unpacked):.1f}% of the padding removed" if packed <= unpacked else
                  "packing adds padding here: a smaller sft.max_length packs tighter")
        return (f"packing: the training conversations in {len(dataset.train)} rows of {dataset.response_width} "
                f"tokens, {100 * packed:.1f}% of the positions padding ({100 * unpacked:.1f}% in a row each: "
                f"{effect})")

    def loss_net(self, net, config):
        return PackedSFTLossNet(net) if self.config.packing else SFTLossNet(net)

    def scorer(self, net):
        return PackedLogProbs(net) if self.config.packing else ResponseLogProbs(net)

    def score(self, outputs, rows):
        return np.array([-(outputs * rows.loss_mask).sum(), rows.loss_mask.sum()])


class RewardModelStage(Stage):
    """Bradley-Terry on pairs; its net is a value model: the starting policy's backbone with a zero head, or a reward
    model (a step folder of this stage, or a converted one) as it is."""

    name, summary, eval_key, percent = "reward_model", "held-out pair accuracy", "eval/accuracy", True
    dataset_class, group_size = PairDataset, 2
    role_name, role_files, prefix = "critic", (CRITIC_CKPT, CRITIC_STRATEGY), CRITIC_PREFIX

    def build_net(self, cfg, layout):
        net = Qwen2ForValue(cfg, layout)
        net.update_parameters_name(self.prefix)
        return net

    def load(self, net, layout, checkpoint: str, seed: int) -> None:
        if not checkpoint:
            random_start(net, layout, seed, self.prefix)
            return
        cfg = net.config
        state = value_model_start(checkpoint, cfg.hidden_size, cfg.value_head_bias)
        load_value_model(net, layout, state, checkpoint, self.prefix, "the reward model", seed)

    def loss_net(self, net, config):
        rm = config.reward_model
        return PairwiseRewardLoss(net, rm.margin, rm.center_rewards_coefficient)

    def scorer(self, net):
        return ResponseScores(net)

    def score(self, outputs, rows):
        chosen, rejected = outputs[0::2], outputs[1::2]
        return np.array([(chosen > rejected).sum(), len(chosen)])


class DPOStage(Stage):
    """DPO on pairs; the reference is the starting policy, whose log-probs of every answer are computed once, before
    the first step, by the train net itself (TRL's `precompute_ref_log_probs`), and kept in the checkpoints."""

    name, summary, eval_key, percent = "dpo", "held-out accuracy", "eval/accuracy", True
    dataset_class, group_size = PairDataset, 2

    def __init__(self, config):
        self.config = config.dpo

    def loss_net(self, net, config):
        del config  # the stage keeps its section
        return DPOLossNet(net, self.config.beta, self.config.label_smoothing, self.config.loss_type)

    def answer_logps(self, logp: np.ndarray, rows) -> np.ndarray:
        """Each row's answer log-prob: summed over its tokens, or their mean for IPO."""
        mask = rows.response_mask
        sums = (logp * mask).sum(axis=1)
        return sums / np.maximum(mask.sum(axis=1), 1) if self.config.loss_type == "ipo" else sums

    def prepare(self, trainer) -> None:
        dataset = trainer.dataset
        if "ref_logps" in dataset.row_values["train"]:
            return  # restored from a checkpoint
        start = time.perf_counter()
        for split in ("train", "held_out"):
            rows = dataset.split_rows(split) if getattr(dataset, split) else None
            values = np.zeros(0 if rows is None else rows.num_rows, np.float32)
            if rows is not None and not self.config.reference_free:
                values = trainer.score_rows(rows, self.answer_logps).astype(np.float32)
            dataset.row_values[split]["ref_logps"] = values
        logger.info("reference log-probs of %d answers computed by the starting policy%s in %.1f s",
                    sum(len(v["ref_logps"]) for v in dataset.row_values.values()),
                    " (reference-free: 0)" if self.config.reference_free else "", time.perf_counter() - start)

    def loop_state(self, dataset) -> dict:
        return {"ref_logps": {split: dataset.row_values[split]["ref_logps"].tolist() for split in dataset.row_values}}

    def load_loop_state(self, dataset, state: dict) -> None:
        for split, values in state["ref_logps"].items():
            dataset.row_values[split]["ref_logps"] = np.asarray(values, np.float32)

    def score(self, outputs, rows):
        logps = self.answer_logps(outputs, rows) - rows.ref_logps
        return np.array([(logps[0::2] > logps[1::2]).sum(), len(logps) // 2])

    def metric_names(self, metrics: dict) -> dict:
        """`dpo/rewards/*` and `dpo/logps/*` as TRL's `rewards/*` and `logps/*`."""
        return {name.removeprefix("dpo/") if name.startswith(("dpo/rewards/", "dpo/logps/")) else name: value
                for name, value in metrics.items()}


def stage_of(name: str, config) -> Stage:
    """The stage `--stage name` runs."""
    if name == "reward":
        return RewardModelStage()
    return {"sft": SFTStage, "dpo": DPOStage}[name](config)
