"""The rank executor's started collectives (hplan.executor.ranks.in_flight), without ranks: each reduction runs beside
exactly one step's compute, a gather issued ahead is waited once where it is used, and finish steps run in order
after the call completes ([Note: collectives in flight])."""

from __future__ import annotations

from hplan.executor.ranks.collectives import Pending
from hplan.executor.ranks.in_flight import InFlight


class _Work:
    """A torch.distributed Work stand-in that records its wait."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> bool:
        self.log.append(f"wait {self.name}")
        return True


def test_reductions_settle_one_event_later_and_finish_steps_run_after_the_wait():
    log: list[str] = []
    flight = InFlight()
    a = Pending(_Work(log, "a"), [])
    a.then(lambda: log.append("a: add to the shard")).then(lambda: log.append("a: free the full gradient"))
    flight.reduction(7, until=3, pending=a)
    flight.reduction(8, until=4, pending=Pending(_Work(log, "b"), []))
    assert log == [] and flight.latest(7) is a
    flight.settle_older(4)  # the event after a's: a ran beside step 3's compute; b (issued at 4) keeps running
    assert log == ["wait a", "a: add to the shard", "a: free the full gradient"]
    assert set(flight.reductions) == {8}
    flight.settle(8)
    flight.settle(8)  # idempotent: nothing in flight on the region any more
    assert log[-1] == "wait b" and not flight.reductions
    a.then(lambda: log.append("late"))  # a step added after completion runs at once
    assert log[-1] == "late"
    assert flight.counts() == (0, 2) and flight.counts() == (0, 0)


def test_a_gather_issued_ahead_is_waited_once_where_used():
    log: list[str] = []
    flight = InFlight()
    flight.gather_ahead(2, Pending(_Work(log, "g"), [lambda: log.append("show weights")]))
    assert not flight.take_gather(5)  # not issued ahead: the step gathers it itself
    assert flight.take_gather(2) and log == ["wait g", "show weights"]
    assert not flight.take_gather(2)
    done = Pending(None, [])  # a completed call is never kept in flight
    flight.reduction(1, until=0, pending=done)
    assert not flight.reductions and flight.counts() == (1, 0)
