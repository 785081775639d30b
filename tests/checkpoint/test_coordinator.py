"""`CheckpointCoordinator`: a step folder holds every role's parameters and state and the loop's, and gives them all
back; what the job does not match, a role state it does not save, or another rank's failure ends the restore in
one line."""
import json
import os

import mindspore as ms
import numpy as np
import pytest

from mindrlhf.checkpoint.coordinator import CheckpointCoordinator
from mindrlhf.checkpoint.step import CheckpointError, complete_checkpoints
from mindrlhf.utils.agreement import PeerFailure


class FakeRole:
    """A role with one parameter file and a counter for its state."""

    def __init__(self, name: str, values):
        self.name = name
        self.param = ms.Parameter(ms.Tensor(np.asarray(values, np.float32)), name=f"{name}.w")
        self.counter, self.resumed = 0, False

    def rank_files(self):
        return {f"{self.name}.ckpt": [self.param]}

    def shared_files(self):
        return {}

    def state_dict(self):
        return {"counter": self.counter}

    def load_state_dict(self, state):
        self.counter = state["counter"]

    def after_resume(self):
        self.resumed = True


def alone(failed):
    return [0] if failed else []


def coordinator(tmp_path, roles, failed_ranks=alone, layouts=None, config=None):
    return CheckpointCoordinator(roles, str(tmp_path), 0, 1, failed_ranks, layouts or {"train": "dp=1 x tp=1"},
                                 config or {"schedule": {"steps": 4, "seed": 1}})


def test_a_saved_step_restores_every_roles_parameters_and_state_and_the_loops(tmp_path):
    actor, critic = FakeRole("actor", [1.0, 2.0]), FakeRole("critic", [3.0])
    actor.counter, critic.counter = 7, 2
    path = coordinator(tmp_path, [actor, critic]).save(3, {"data": {"epoch": 1, "index": 5}}, keep_last=2)
    assert complete_checkpoints(str(tmp_path)) == [path] and path.endswith("step_000003")
    assert json.load(open(os.path.join(path, "rank_0", "state.json"))) == {"actor": {"counter": 7},
                                                                          "critic": {"counter": 2}}
    fresh_actor, fresh_critic = FakeRole("actor", [0.0, 0.0]), FakeRole("critic", [0.0])
    meta = coordinator(tmp_path, [fresh_actor, fresh_critic]).restore(path)
    assert meta["step"] == 3 and meta["data"] == {"epoch": 1, "index": 5}
    np.testing.assert_array_equal(fresh_actor.param.asnumpy(), [1.0, 2.0])
    np.testing.assert_array_equal(fresh_critic.param.asnumpy(), [3.0])
    assert (fresh_actor.counter, fresh_critic.counter) == (7, 2) and fresh_actor.resumed and fresh_critic.resumed


def test_a_restore_that_does_not_fit_the_job_is_one_error(tmp_path):
    path = coordinator(tmp_path, [FakeRole("actor", [1.0])]).save(1, {}, keep_last=2)
    with pytest.raises(CheckpointError, match=r"step_000001: config differs from the checkpoint's: schedule.seed 1 "
                                              r"-> 2"):
        coordinator(tmp_path, [FakeRole("actor", [1.0])], config={"schedule": {"steps": 9, "seed": 2}}).restore(path)
    with pytest.raises(CheckpointError, match=r"step_000001: train layout dp=1 x tp=1 differs from this job's "
                                              r"dp=1 x tp=2"):
        coordinator(tmp_path, [FakeRole("actor", [1.0])], layouts={"train": "dp=1 x tp=2"}).restore(path)
    with pytest.raises(CheckpointError, match=r"rank_0/critic.ckpt: missing from the checkpoint"):
        coordinator(tmp_path, [FakeRole("actor", [1.0]), FakeRole("critic", [1.0])]).restore(path)


def test_a_role_state_the_job_does_not_save_and_another_ranks_failure_end_the_restore(tmp_path):
    path = coordinator(tmp_path, [FakeRole("actor", [1.0])]).save(1, {}, keep_last=2)
    with open(os.path.join(path, "rank_0", "state.json"), "w") as f:
        json.dump({"actor": {}}, f)
    with pytest.raises(CheckpointError, match=r"state.json: not the state this job saves \(no 'counter' for its "
                                              r"roles \['actor'\]\)"):
        coordinator(tmp_path, [FakeRole("actor", [1.0])]).restore(path)
    with open(os.path.join(path, "rank_0", "state.json"), "w") as f:
        json.dump({"actor": {"counter": 1}}, f)
    role = FakeRole("actor", [5.0])
    with pytest.raises(PeerFailure, match=r"stopped at reading .*step_000001: rank 1 failed there"):
        coordinator(tmp_path, [role], failed_ranks=lambda failed: [1]).restore(path)
    assert not role.resumed  # nothing goes on past a failed agreement
