"""`Batcher`: calls that arrive together run together, and each gets its own answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from prefect_gpu_budget.admission.ledger.batches import Batcher


def _run_together(batcher: Batcher, args: list[int]) -> dict[int, object]:
    got: dict[int, object] = {}
    start = threading.Barrier(len(args))

    def one(arg: int) -> None:
        start.wait()
        try:
            got[arg] = batcher.call(arg)
        except Exception as exc:
            got[arg] = exc

    threads = [threading.Thread(target=one, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_each_call_gets_its_own_result_and_waiters_share_a_run():
    runs: list[Sequence[int]] = []

    def run(args: Sequence[int]) -> list[int]:
        runs.append(list(args))
        time.sleep(0.05)  # long enough for the others to line up behind the first run
        return [a * 10 for a in args]

    got = _run_together(Batcher(run), list(range(64)))
    assert got == {a: a * 10 for a in range(64)}
    assert sorted(a for r in runs for a in r) == list(range(64))  # each call run once
    assert len(runs) < 64  # calls that arrived during a run went together into the next


def test_one_bad_call_fails_only_itself():
    def run(args: Sequence[int]) -> list[int]:
        if 13 in args:
            raise ValueError("thirteen")
        time.sleep(0.01)
        return list(args)

    got = _run_together(Batcher(run), list(range(32)))
    assert isinstance(got.pop(13), ValueError)
    assert got == {a: a for a in range(32) if a != 13}


def test_a_run_takes_at_most_most_calls():
    sizes: list[int] = []

    def run(args: Sequence[int]) -> list[int]:
        sizes.append(len(args))
        time.sleep(0.02)
        return list(args)

    got = _run_together(Batcher(run, most=4), list(range(40)))
    assert len(got) == 40 and max(sizes) <= 4


def test_an_interrupted_leader_leaves_the_others_to_the_next_run():
    calls: list[list[int]] = []
    first = threading.Event()

    def run(args: Sequence[int]) -> list[int]:
        calls.append(list(args))
        if len(calls) == 1:
            first.wait(5)
            raise KeyboardInterrupt  # not an Exception: only its own caller sees it
        return list(args)

    batcher: Batcher[int, int] = Batcher(run)
    errors: list[BaseException] = []

    def lead() -> None:
        try:
            batcher.call(0)
        except BaseException as exc:
            errors.append(exc)

    leader = threading.Thread(target=lead)
    leader.start()
    while not calls:
        time.sleep(0.01)
    got: dict[int, int] = {}
    others = [
        threading.Thread(target=lambda a=a: got.__setitem__(a, batcher.call(a))) for a in (1, 2)
    ]
    for t in others:
        t.start()
    time.sleep(0.1)
    first.set()
    for t in [leader, *others]:
        t.join(10)
    assert [type(e) for e in errors] == [KeyboardInterrupt]
    assert got == {1: 1, 2: 2}


@pytest.mark.parametrize("n", [1, 2])
def test_a_lone_call_runs_at_once(n: int):
    assert _run_together(Batcher(lambda args: [a + 1 for a in args]), list(range(n))) == {
        a: a + 1 for a in range(n)
    }
