"""Host swap: named groups of parameters moved to host memory and back around each phase.

On Ascend a group is offloaded with `Parameter._offload()` (copies to host and frees the device memory) and
loaded back with `Parameter._load()`. Elsewhere (CPU) these calls are no-ops, so only the bookkeeping runs;
the phase plan (what is resident when) is logged, can be asserted, and is reported in bytes either way.

Using an offloaded group is an error: the code that runs a net first calls :meth:`SwapManager.check_resident`
(the trainer's roles do), which raises naming the operation and the groups. Group names are the caller's (the
RL roles live in `mindrlhf.trainer.roles`). In ``debug`` mode on a
backend without real offload, offloading also stashes a copy of the values and fills float parameters with
NaN until they are loaded again, so a read that bypasses the checks shows up as NaN in CPU tests.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter

logger = logging.getLogger(__name__)

_OFFLOAD, _LOAD = "offload", "load"


class SwapError(RuntimeError):
    """A swap group used or planned wrongly; the message names the phase/operation and the groups."""


@dataclass(frozen=True)
class SwapEvent:
    """One transition of one group."""

    phase: str
    group: str
    action: str  # "offload" or "load"
    nbytes: int
    seconds: float


@dataclass
class _Group:
    params: tuple
    nbytes: int
    resident: bool = True
    growing: bool = False
    stash: tuple | None = None  # debug copies while offloaded (simulated offload only)


def format_bytes(nbytes: int) -> str:
    """Human-readable size (binary units)."""
    if nbytes < 1024:
        return f"{nbytes} B"
    size = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.2f} {unit}"


def param_nbytes(param) -> int:
    """Bytes of a parameter's local data."""
    return int(param.nbytes)


class SwapManager:
    """Named parameter groups with offload/load, residency checks and a transition log."""

    def __init__(self, debug: bool = False, device_target: str | None = None):
        self.debug = debug
        self._device_target = device_target
        self._groups: dict[str, _Group] = {}
        self._owner: dict[int, str] = {}  # id(param) -> group
        self._owner_by_name: dict[str, str] = {}
        self.events: list[SwapEvent] = []
        self.phase_plan: list[tuple[str, tuple[str, ...]]] = []  # (phase, resident groups) after each plan

    # ---------------------------------------------------------------- registration
    def register(self, group: str, params: Iterable, growing: bool = False) -> int:
        """Adds group `group` holding `params` (all resident); returns its size in bytes. A `growing` group (buffers
        made on first use, such as KV caches) may start empty and take more parameters with `extend`."""
        if group in self._groups:
            raise SwapError(f"swap group '{group}' is already registered; register all its parameters at once")
        params = tuple(params)
        if not params and not growing:
            raise SwapError(f"swap group '{group}': no parameters given")
        self._check_new_params(group, params)
        for param in params:
            self._owner[id(param)] = group
            self._owner_by_name[param.name] = group
        nbytes = sum(param_nbytes(p) for p in params)
        self._groups[group] = _Group(params, nbytes, growing=growing)
        logger.debug("swap group '%s' registered: %d parameters, %s", group, len(params), format_bytes(nbytes))
        return nbytes

    def extend(self, group: str, params: Iterable) -> int:
        """Adds `params` to the growing group `group`, which must be resident (they were just made in a phase that
        uses it); returns the group's new size in bytes."""
        state, params = self._group(group), tuple(params)
        if not state.growing:
            raise SwapError(f"swap group '{group}' was registered whole; only a growing group takes more parameters")
        if not state.resident:
            raise SwapError(f"swap group '{group}' is offloaded: its buffers can only be made in a phase where it is "
                            "resident")
        self._check_new_params(group, params)
        for param in params:
            self._owner[id(param)] = group
            self._owner_by_name[param.name] = group
        state.params += params
        state.nbytes += sum(param_nbytes(p) for p in params)
        return state.nbytes

    def _check_new_params(self, group: str, params: tuple) -> None:
        seen: dict[str, int] = {}
        for index, param in enumerate(params):
            if not isinstance(param, Parameter):
                raise TypeError(f"swap group '{group}': item {index} is a {type(param).__name__}, "
                                "expected mindspore.Parameter")
            other = self._owner.get(id(param)) or self._owner_by_name.get(param.name)
            if other is not None:
                raise SwapError(f"parameter '{param.name}' is already in swap group '{other}'; "
                                f"it cannot also be in group '{group}'")
            if param.name in seen:
                raise SwapError(f"swap group '{group}': parameter '{param.name}' given twice "
                                f"(items {seen[param.name]} and {index})")
            seen[param.name] = index

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(self._groups)

    def params(self, group: str) -> tuple:
        return self._group(group).params

    def group_bytes(self, group: str) -> int:
        """Size of the group whether resident or not."""
        return self._group(group).nbytes

    def _group(self, group: str) -> _Group:
        if group not in self._groups:
            known = ", ".join(self._groups) or "none"
            raise SwapError(f"unknown swap group '{group}' (registered: {known})")
        return self._groups[group]

    # ---------------------------------------------------------------- transitions
    @property
    def device_target(self) -> str:
        if self._device_target is None:
            return ms.get_context("device_target")
        return self._device_target

    @property
    def offloads_for_real(self) -> bool:
        """True where `Parameter._offload/_load` move memory (Ascend); elsewhere only bookkeeping runs."""
        return self.device_target == "Ascend"

    def offload(self, group: str, phase: str = "") -> int:
        """Moves `group` to host memory; returns the bytes moved (0 if it already was offloaded)."""
        return self._transition(group, _OFFLOAD, phase)

    def load(self, group: str, phase: str = "") -> int:
        """Moves `group` back to the device; returns the bytes moved (0 if it already was resident)."""
        return self._transition(group, _LOAD, phase)

    def _transition(self, group: str, action: str, phase: str) -> int:
        state = self._group(group)
        if state.resident == (action == _LOAD):
            logger.debug("swap %s of '%s' skipped (phase %s): already %s", action, group, phase or "-",
                         "resident" if state.resident else "offloaded")
            return 0
        start = time.perf_counter()
        if action == _OFFLOAD:
            self._offload_params(state)
        else:
            self._load_params(state)
        state.resident = action == _LOAD
        event = SwapEvent(phase, group, action, state.nbytes, time.perf_counter() - start)
        self.events.append(event)
        logger.debug("swap %s %s: %d parameters, %s in %.3f s (phase %s%s)", action, group, len(state.params),
                    format_bytes(state.nbytes), event.seconds, phase or "-",
                    "" if self.offloads_for_real else ", bookkeeping only")
        return state.nbytes

    def _offload_params(self, state: _Group) -> None:
        if self.offloads_for_real:
            for param in state.params:
                param._offload()  # pylint: disable=protected-access
        elif self.debug:
            state.stash = tuple(param.data.copy() for param in state.params)
            for param in state.params:
                _poison(param)

    def _load_params(self, state: _Group) -> None:
        if self.offloads_for_real:
            for param in state.params:
                param._load()  # pylint: disable=protected-access
        elif state.stash is not None:
            for param, saved in zip(state.params, state.stash):
                param.set_data(saved)
            state.stash = None

    def apply_plan(self, phase: str, resident: Iterable[str] = (), offloaded: Iterable[str] = ()) -> int:
        """Offloads `offloaded`, then loads `resident` (lower peak); returns bytes moved. Logs the plan."""
        resident, offloaded = tuple(resident), tuple(offloaded)
        self._check_plan_groups(resident, offloaded, phase)
        moved = sum(self.offload(g, phase) for g in offloaded) + sum(self.load(g, phase) for g in resident)
        self.phase_plan.append((phase, tuple(g for g in self._groups if self._groups[g].resident)))
        return moved

    # ---------------------------------------------------------------- checks
    def is_resident(self, group: str) -> bool:
        return self._group(group).resident

    def resident_bytes(self) -> dict[str, int]:
        """Device bytes held by each group now (0 for an offloaded group)."""
        return {name: (g.nbytes if g.resident else 0) for name, g in self._groups.items()}

    def assert_plan(self, resident: Iterable[str] = (), offloaded: Iterable[str] = (), phase: str = "") -> None:
        """Raises SwapError naming `phase` and every group not in the expected state."""
        resident, offloaded = tuple(resident), tuple(offloaded)
        self._check_plan_groups(resident, offloaded, phase)
        not_resident = [g for g in resident if not self._groups[g].resident]
        not_offloaded = [g for g in offloaded if self._groups[g].resident]
        if not_resident or not_offloaded:
            problems = []
            if not_resident:
                problems.append(f"expected resident but offloaded: {', '.join(not_resident)}")
            if not_offloaded:
                problems.append(f"expected offloaded but resident: {', '.join(not_offloaded)}")
            raise SwapError(f"swap plan violated in phase '{phase}': {'; '.join(problems)}")

    def _check_plan_groups(self, resident: tuple, offloaded: tuple, phase: str) -> None:
        for group in resident + offloaded:
            self._group(group)
        both = sorted(set(resident) & set(offloaded))
        if both:
            raise SwapError(f"phase '{phase}': group(s) {', '.join(both)} both resident and offloaded in the plan")

    def check_resident(self, groups: str | Iterable[str], op_name: str) -> None:
        """Raises SwapError if `op_name` is about to use an offloaded group."""
        groups = (groups,) if isinstance(groups, str) else tuple(groups)
        offloaded = [g for g in groups if not self._group(g).resident]
        if offloaded:
            raise SwapError(f"'{op_name}' uses offloaded swap group(s) {', '.join(offloaded)}; "
                            f"load them first (resident now: {', '.join(self._resident_names()) or 'none'})")

    def _resident_names(self) -> list[str]:
        return [name for name, g in self._groups.items() if g.resident]

    # ---------------------------------------------------------------- reporting
    def summary(self) -> str:
        """Multi-line report: each group's size, state and traffic, and the last plan of each phase."""
        mode = "real offload" if self.offloads_for_real else "bookkeeping only"
        lines = [f"swap groups ({self.device_target}, {mode}{', debug' if self.debug else ''}):"]
        for name, group in self._groups.items():
            events = [e for e in self.events if e.group == name]
            moved = sum(e.nbytes for e in events)
            lines.append(f"  {name:<18} {format_bytes(group.nbytes):>12}  "
                         f"{'resident ' if group.resident else 'offloaded'}  "
                         f"offloads={sum(e.action == _OFFLOAD for e in events)} "
                         f"loads={sum(e.action == _LOAD for e in events)} moved={format_bytes(moved)}")
        last_plan = dict(self.phase_plan)
        for phase, resident in last_plan.items():
            lines.append(f"  phase {phase or '-'}: resident {', '.join(resident) or 'none'} "
                         f"({format_bytes(sum(self._groups[g].nbytes for g in resident))})")
        return "\n".join(lines)


def _poison(param) -> None:
    """Fills a float parameter with NaN (debug stand-in for device memory that is gone)."""
    if param.dtype in ms.common.dtype.float_type:
        param.set_data(ms.Tensor(np.full(param.shape, np.nan, dtype=np.float32), dtype=param.dtype))
