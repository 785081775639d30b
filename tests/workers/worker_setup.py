"""The set-up the worker scripts share. They run as `python tests/workers/<w>.py` or under msrun (not imported by
pytest), so `import worker_setup` (their folder is on sys.path) comes first: it puts `tests/` on sys.path, for
`support` (the tiny configs, shared cells and batches; `support.paths` for the repository's paths), and the
repository root, for the library and the examples. The functions import MindSpore only when called."""
import os
import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent.parent)  # tests/: the one place a worker finds it from its own path
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from support.paths import ROOT  # noqa: E402

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def graph_mode_on_cpu() -> None:
    """MindSpore in GRAPH_MODE on CPU, as the trainer runs; the objects of the imports frozen out of the garbage
    collector's walk before each compile, as the trainer's (`freeze_long_lived_objects`)."""
    import mindspore as ms

    from mindrlhf.trainer.launch import freeze_long_lived_objects

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    freeze_long_lived_objects()


def set_max_call_depth(depth: int) -> None:
    """Graph mode's call depth limit (MindSpore's default 1000): the graphs compiled next must stay within it."""
    import mindspore as ms

    ms.set_context(max_call_depth=depth)


def init_communication() -> tuple[int, int]:
    """Communication initialised as the trainer's (the process was launched by msrun): (world size, this rank)."""
    from mindrlhf.trainer.launch import start_communication

    return start_communication()


def save_rank_results(out: str, rank: int, results: dict) -> None:
    """`results` (name -> array) to `<out>/rank_<rank>.npz`, what `support.msrun.load_ranks` reads."""
    import numpy as np

    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, f"rank_{rank}.npz"), **results)


def run_worker_script(main) -> None:
    """Runs `main()` (which returns None or an exit code) and ends the process as the trainer's script does
    (`mindrlhf.trainer.launch.run_script`: faulthandler on, a barrier, the exit handlers, no interpreter teardown)."""
    from mindrlhf.trainer.launch import run_script

    run_script(lambda: main() or 0)


_communication: tuple[int, int] | None = None


def communication() -> tuple[int, int]:
    """`init_communication()` once per process (the cases of one launch share it): (world size, this rank)."""
    global _communication
    if _communication is None:
        _communication = init_communication()
    return _communication


def run_cases(run_case, argv: list[str] | None = None) -> None:
    """`run_case(case_argv)` for each case of this process's command line, one after the other: `--cases <file>`
    names a JSON list of argument lists (one launch, one start-up, for several cases; `support.cases` writes it);
    any other command line is the one case. A case that fails is named on stderr before its error."""
    import json

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] != ["--cases"]:
        run_case(argv)
        return
    with open(argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    for number, case in enumerate(cases, 1):
        try:
            run_case(case)
        except BaseException:
            print(f"case {number} of {len(cases)} failed: {' '.join(case)}", file=sys.stderr, flush=True)
            raise
