"""The trainer's step folders (`mindrlhf.checkpoint.step`): the roles' saved states, today's and older ones."""
from mindrlhf.checkpoint.step import role_states

RNG = {"bit_generator": "PCG64", "state": {"state": 7, "inc": 3}, "has_uint32": 0, "uinteger": 0}


def test_the_saved_role_states_are_read_as_written():
    saved = {"actor": {"engine": {"updates": 8, "consecutive_skips": 1}, "generator_rng": RNG}, "reference": {}}
    assert role_states(saved, {"step": 2}) == saved


def test_a_checkpoint_of_before_the_roles_states_reads_as_todays():
    """Until 2026-11-28 a rank's state was the actor's sampling stream alone and the engines' update counts sat in
    the meta (`updates`, `critic_updates`): such a checkpoint resumes with the same counts."""
    assert role_states({"generator_rng": RNG}, {"step": 2, "updates": 8}) == {
        "actor": {"generator_rng": RNG, "engine": {"updates": 8, "consecutive_skips": 0}}}
    assert role_states({"generator_rng": RNG}, {"step": 2, "updates": 8, "critic_updates": 6})["critic"] == {
        "engine": {"updates": 6, "consecutive_skips": 0}}
