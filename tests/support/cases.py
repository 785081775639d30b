"""Runs of a worker script that a test module's tests read, launched together: every run of one process count in one
launch (the worker loops over them, `worker_setup.run_cases`), so that a module pays msrun's start-up (Python,
MindSpore, the cluster) once per world size instead of once per case, and a run two tests read is launched once.

    RUNS = {"tp2": Run(2, ["--tp", "2"]), "reference": Run(1, [])}

    @pytest.fixture(scope="module")
    def runs(request, tmp_path_factory):
        return Runs("my_worker.py", tmp_path_factory.mktemp("runs"), RUNS, selected(request, "run"))

    def test_x(runs, run):
        ranks = load_ranks(runs(run), RUNS[run].workers)

`runs(name)` returns the run's folder, after launching it if it has not run yet: together with every other wanted
run of its process count not launched yet (each with `--out <its own folder>` added), after the runs they need
(`Run.after`). The wanted runs are those this session's tests ask for (`selected`: what `-k` left) and the runs
those need. A failed launch fails every test that reads one of its runs, with the launch's error.

The first test to read a launch's runs waits for the whole launch (and for the launches of the runs it needs):
`waits_for(launches)` gives it the pytest-timeout that allows for them (each launch stops itself, workers included,
past `LAUNCH_TIMEOUT`)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support.msrun import run_worker

LAUNCH_TIMEOUT = 840  # seconds


def waits_for(launches: int):
    """pytest-timeout's mark for a test that may wait for `launches` launches of `Runs`."""
    return pytest.mark.timeout(launches * LAUNCH_TIMEOUT + 60)


@dataclass(frozen=True)
class Run:
    workers: int  # processes (1: plain Python, no msrun)
    args: list[str]  # the worker's arguments, `--out` left out
    after: tuple[str, ...] = field(default=())  # runs whose output this one reads (launched before it)


def selected(request, argname: str) -> set:
    """The values of the parametrised argument `argname` among this session's tests of the requesting module."""
    found = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "module", None) is request.module and argname in params:
            found.add(params[argname])
    return found


class Runs:
    def __init__(self, script: str, root: Path, runs: dict[str, Run], wanted, timeout: int = LAUNCH_TIMEOUT):
        """`wanted`: the names of the runs the session's tests read (others are not launched); `timeout`: seconds
        per launch."""
        self.script, self.root, self.runs, self.timeout = script, Path(root), runs, timeout
        self.wanted = set()
        for name in wanted:
            self._want(name)
        self.launched: dict[str, AssertionError | None] = {}  # the runs launched: None, or their launch's error

    def _want(self, name: str) -> None:
        self.wanted.add(name)
        for needed in self.runs[name].after:
            self._want(needed)

    def out(self, name: str) -> Path:
        """The run's output folder (whether it ran or not)."""
        return self.root / re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)

    def __call__(self, name: str) -> Path:
        """The run's output folder, after the launch that ran it (with every other wanted run of its process count
        not launched yet)."""
        if name not in self.launched:
            self._want(name)
            workers = self.runs[name].workers
            group = [n for n, run in self.runs.items() if run.workers == workers and n in self.wanted and
                     n not in self.launched]
            for needed in {a for n in group for a in self.runs[n].after}:
                self(needed)
            error = None
            try:
                self._launch(workers, group)
            except AssertionError as failed:
                error = failed
            self.launched.update(dict.fromkeys(group, error))
            if error is not None:
                raise error
        if self.launched[name] is not None:
            raise AssertionError(f"the launch of {self.script} that ran {name!r} failed: "
                                 f"{str(self.launched[name])[:3000]}")
        return self.out(name)

    def _launch(self, workers: int, names: list[str]) -> None:
        """One launch of `workers` processes running the runs `names` in turn; its cases file and logs in
        <root>/launch_<n>."""
        folder = self.root / f"launch_{sum(1 for _ in self.root.glob('launch_*'))}"
        folder.mkdir(parents=True)
        cases_file = folder / "cases.json"
        cases_file.write_text(json.dumps([[*self.runs[n].args, "--out", str(self.out(n))] for n in names], indent=1))
        run_worker(self.script, ["--cases", str(cases_file)], workers, folder / "log", self.timeout)
