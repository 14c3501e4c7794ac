"""Lockstep rounds: fresh processes that take turns step by step, so they see the same machine (bench section 13).

[Note: lockstep rounds] Issue 32's goals compare hplan's step with plain PyTorch's, each in its own process (its
own allocator and heap, one torch thread). Run one after the other, seconds apart, the two see different loads:
on the shared 2-core machine single rounds of fresh processes spread 0.7-1.7x and the median over 15 moved ±8%
between quiet runs. Here the processes of a round are started together, do their imports, workload and plan
(set-up, untimed) and then take turns through pipes, a step each:
- the parent holds the turn. A child hands it back by writing one byte (`Turns.hand_over`: once when its set-up
  is done, then after each step) and then blocks in `os.read` on its own pipe until the parent's next byte; the
  parent gives the turn to the next child only once the previous one has handed it back. So one process computes
  at any moment, a step of one follows a step of the other, and the load both see is the same from one step to
  the next. A waiting child sleeps in the kernel (no spinning: it takes no core from the one that runs) and the
  kernel wakes it when its byte arrives.
- each step is timed inside its own process (perf_counter around the step only: the hand-over is outside it, as
  are the parent's wake-up between turns and the next child's), as in a run alone; the first step (set-up's
  allocations) is left out of the medians, as before. hplan's worker and copier threads finish a
  step's work before the step returns ([Note: overlapped host updates], [Note: offload beside the forward] in
  hplan.executor), so nothing of one system runs in the other's turn.
- who goes first alternates (the caller passes `first`); each child gets exactly `steps` turns, and must report
  `turns` = steps + 1 hand-overs (set-up included) in its JSON line, or the round fails.
- after the last step every child is blocked again; the parent lets them finish one at a time (in turn order), so
  what a child measures after its steps (bench.speed_runs: the memcpy time of its bytes) runs alone too.
- a child that dies closes its end of the pipe: the parent's read returns at once and the round raises, naming the
  child, its exit status and its last stderr line; one that hangs raises after `timeout` seconds. Either way every
  child is killed: a crash never hangs the bench. A child whose parent is gone reads end-of-file and exits.
- caches: each step starts right after the other process's step has run on the same cores, so it finds the
  caches holding the other's data: the same for both systems (as in a loop whose data loader or logging runs
  between steps).
- what lockstep does not remove: load from outside that lands inside one step and not the other's (medians over
  each process's steps, then over rounds), and what differs between two processes (where the heap and the
  model's tensors fall in memory): that is what rounds of fresh processes average out.

[Note: one core for both] Unpinned, the kernel puts each woken child on a core of its choice, and on this VM the two
vCPUs are not alike (neighbours' load lands on one, not the other): a round whose plain child mostly ran on one core
and hplan's on the other reads that difference for its whole length. Measured on 2026-11-30 (gpt:small, quiet
machine, 6 rounds each way, interleaved in one run, /tmp script): the per-round ratio's standard deviation was
0.077 unpinned against 0.024 with both children pinned to the same core (all-resident), 0.131 against 0.027 at the
minimum budget. So `lockstep(cores=...)` pins every child of a round to the same cores (set before exec, so torch
starts pinned), and section 13 pins each round to one core, the next round to the next core. A pinned hplan sees
one core: its `overlap="auto"` then runs activation copies and host updates in line (no spare core), as plain
PyTorch with one torch thread has one core; the goal at the minimum budget counts the copies' memcpy time.
Plumbing only: no torch, so its tests run tiny children in well under a second.
"""

from __future__ import annotations

import os
import select
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

ENV = "BENCH_LOCKSTEP_FDS"
"""The child's environment: "GO,BACK", the pipe it reads its turn from and the one it hands it back on."""


class Turns:
    """The child's side of [Note: lockstep rounds]."""

    def __init__(self, go: int, back: int) -> None:
        self.go, self.back, self.count = go, back, 0

    @classmethod
    def from_env(cls) -> Turns | None:
        """This process's turns when a lockstep parent started it, else None."""
        fds = os.environ.get(ENV)
        if not fds:
            return None
        go, back = (int(x) for x in fds.split(","))
        return cls(go, back)

    def hand_over(self) -> None:
        """Give the turn back, then sleep until the parent gives it again (after this child's set-up, then after
        each step, outside the step's timing)."""
        os.write(self.back, b"t")
        self.count += 1
        if os.read(self.go, 1) != b"g":
            raise RuntimeError("lockstep: the parent process is gone")


class _Child:
    def __init__(self, name: str, cmd: Sequence[str], env: Mapping[str, str], cwd: str | None,
                 cores: frozenset[int] | None = None) -> None:
        go_r, self.go = os.pipe()
        self.back, back_w = os.pipe()
        self.out: IO[bytes] = tempfile.TemporaryFile()
        self.err: IO[bytes] = tempfile.TemporaryFile()
        self.name = name
        try:
            pin = None if cores is None else lambda: os.sched_setaffinity(0, cores)  # before exec: torch starts pinned
            self.proc = subprocess.Popen(list(cmd), stdout=self.out, stderr=self.err, cwd=cwd, pass_fds=(go_r, back_w),
                                         env={**env, ENV: f"{go_r},{back_w}"}, preexec_fn=pin)
        except OSError:
            for f in (self.go, self.back):
                os.close(f)
            self.out.close()
            self.err.close()
            raise
        finally:
            os.close(go_r)  # the child's ends: once it exits, reading `back` returns end-of-file
            os.close(back_w)

    def give(self, what: str) -> None:
        try:
            os.write(self.go, b"g")
        except BrokenPipeError:  # it exited after its last hand-over
            raise RuntimeError(f"{self.name} exited {self._status()} ({what}): {self.last_error()}") from None

    def take_back(self, timeout: float, what: str) -> None:
        ready, _, _ = select.select([self.back], [], [], timeout)
        if not ready:
            raise RuntimeError(f"{self.name}: no hand-over within {timeout:.0f} s ({what})")
        if os.read(self.back, 1) != b"t":
            raise RuntimeError(f"{self.name} exited {self._status()} ({what}): {self.last_error()}")

    def _status(self) -> str:
        try:
            return str(self.proc.wait(timeout=5))
        except subprocess.TimeoutExpired:
            return "(still running)"

    def last_error(self) -> str:
        self.err.seek(0)
        lines = self.err.read().decode(errors="replace").strip().splitlines()
        return lines[-1][:200] if lines else "no output"

    def finish(self, timeout: float) -> dict[str, Any]:
        from bench.harness import parse_last_json

        self.give("after its steps")
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{self.name}: still running {timeout:.0f} s after its last turn") from None
        self.out.seek(0)
        payload = parse_last_json(self.out.read().decode(errors="replace"))
        if rc != 0 or payload is None:
            raise RuntimeError(f"{self.name} exited {rc} after its steps: {self.last_error()}")
        return payload

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for fd in (self.go, self.back):
            os.close(fd)
        self.out.close()
        self.err.close()


def lockstep(cmds: Mapping[str, Sequence[str]], *, steps: int, first: int = 0, timeout: float = 300.0,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             cores: frozenset[int] | None = None) -> dict[str, dict[str, Any]]:
    """One round: every command of `cmds` (name → argv) in a fresh process, started together; once all are set
    up, `steps` turns each in turn, the one at index `first` first; then each finishes in that order. Returns the
    JSON object each printed last, by name. `cores`: every child runs on these cores only ([Note: one core for
    both]). Raises RuntimeError naming the child that died, hung (`timeout` seconds for any one turn, set-up
    included) or reported another number of turns."""
    if not cmds or steps < 1:
        raise ValueError(f"lockstep needs commands and steps ≥ 1, got {len(cmds)} and {steps}")
    names = list(cmds)
    order = names[first % len(names):] + names[:first % len(names)]
    children: dict[str, _Child] = {}
    try:
        for name in names:
            children[name] = _Child(name, cmds[name], os.environ if env is None else env, cwd, cores)
        deadline = time.monotonic() + timeout
        for name in order:  # set-up: all at once
            children[name].take_back(max(0.0, deadline - time.monotonic()), "set-up")
        for step in range(steps):
            for name in order:
                what = f"step {step + 1} of {steps}"
                children[name].give(what)
                children[name].take_back(timeout, what)
        out = {name: children[name].finish(timeout) for name in order}
    finally:
        for child in children.values():
            child.close()
    for name, payload in out.items():
        if payload.get("turns") != steps + 1:
            raise RuntimeError(f"{name} handed over {payload.get('turns')} turns, not {steps + 1} (set-up and "
                               f"{steps} steps)")
    return out
