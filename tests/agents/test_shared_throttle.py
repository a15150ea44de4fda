"""The gateways' limits counted in one Redis (`agents.throttle.RedisStore`), against the real
Redis the suite shares (GPU_BUDGET_TEST_REDIS_URL, default redis://127.0.0.1:6379): each test
counts under a key prefix of its own and deletes only its own keys after. No Redis there is a
failure, not a skip. Two real `agents serve` processes sharing these limits:
tests/agents/test_gateways_share_limits.py.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from prefect_gpu_budget.agents.throttle import (
    NAMESPACE,
    RETRY_WHEN_DOWN_S,
    RedisStore,
    Window,
)

REDIS_URL = os.environ.get("GPU_BUDGET_TEST_REDIS_URL", "redis://127.0.0.1:6379")


def _prefix() -> str:
    return f"gpu-budget-test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def shared() -> Iterator[RedisStore]:
    """A store on the shared Redis under a prefix of this test's; its keys deleted after."""
    counts = RedisStore(REDIS_URL, prefix=_prefix())
    try:
        counts.client.ping()
    except Exception as exc:  # a failure: the shared limits are what these tests are for
        pytest.fail(f"no Redis at {REDIS_URL} (GPU_BUDGET_TEST_REDIS_URL): {exc}")
    try:
        yield counts
    finally:
        for key in counts.client.scan_iter(match=f"{counts.prefix}*", count=500):
            counts.client.delete(key)
        counts.client.close()


def _keys(counts: RedisStore) -> list[str]:
    return sorted(k.decode() for k in counts.client.scan_iter(match=f"{counts.prefix}*"))


def test_the_shared_window_counts_as_the_local_one_does(shared):
    pair = ("192.0.2.7", "gpub_abcdefg")
    for window in (Window(3, 30.0), shared.window("bad-tokens", 3, 30.0)):
        assert window.retry_after(pair) == 1 and not window.full(pair)
        assert [window.hit(pair) for _ in range(5)] == [False, False, False, True, True]
        assert window.full(pair) and not window.full(("192.0.2.7", "gpub_other"))
        assert 29 <= window.retry_after(pair) <= 30
    # one key per counted key, named by the token's prefix only, gone a window after its last
    (key,) = _keys(shared)
    assert key == f'{shared.prefix}bad-tokens:["192.0.2.7","gpub_abcdefg"]'
    assert 0 < shared.client.pttl(key) <= 30_000


def test_keys_seen_once_leave_with_their_window(shared):
    brief = shared.window("bad-tokens", 1, 1.0)
    for n in range(50):  # a storm of one-off keys
        brief.hit(("192.0.2.1", f"gpub_{n}"))
    assert 0 < len(_keys(shared)) <= 50  # (a loaded machine may take a window over them)
    time.sleep(1.2)
    assert _keys(shared) == [] and not brief.full(("192.0.2.1", "gpub_0"))


def test_the_window_counts_refused_events_too_and_frees_as_they_leave(shared):
    window = shared.window("calls", 2, 2.0)
    window.hit("grant"), time.sleep(1.0), window.hit("grant")
    assert window.hit("grant")  # one too many, counted as the local window counts it
    assert window.retry_after("grant") == 2
    time.sleep(1.2)
    assert window.full("grant")  # the first left; the two of t=1 are still in
    time.sleep(1.0)
    assert not window.full("grant") and not window.hit("grant")


# -- racing gateways: many processes, many threads each, one last slot ------------------------

PROCESSES, THREADS = 4, 16


def _race(prefix: str, what: str, start: float, out: multiprocessing.Queue) -> None:
    """One gateway's threads, all asking at `start` (a wall-clock time)."""
    counts = RedisStore(REDIS_URL, prefix=prefix)
    window = counts.window("race", 37, 60.0)
    slots = counts.slots("race", 2, 3)
    answers: list[tuple[str, bool]] = []
    gate = threading.Barrier(THREADS)

    def one(n: int) -> None:
        gate.wait()
        if what == "window":
            answers.append(("w", window.hit("10.0.0.1")))
        else:
            key = f"grant-{n % 3}"
            answers.append((key, slots.take(key)))

    threads = [threading.Thread(target=one, args=(n,)) for n in range(THREADS)]
    time.sleep(max(0.0, start - time.time()))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put(answers)


def _racing(prefix: str, what: str) -> list[tuple[str, bool]]:
    spawn = multiprocessing.get_context("spawn")
    out = spawn.Queue()
    start = time.time() + 5  # all spawned and connected by then
    procs = [spawn.Process(target=_race, args=(prefix, what, start, out)) for _ in range(PROCESSES)]
    for proc in procs:
        proc.start()
    answers = [a for _ in procs for a in out.get(timeout=120)]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    return answers


def test_racing_gateways_pass_exactly_the_windows_limit(shared):
    answers = _racing(shared.prefix, "window")
    assert len(answers) == PROCESSES * THREADS
    assert sum(not over for _, over in answers) == 37  # 64 hits at once, 37 pass: never more
    assert shared.window("race", 37, 60.0).full("10.0.0.1")


def test_racing_gateways_take_no_more_slots_than_per_key_and_in_all(shared):
    answers = _racing(shared.prefix, "slots")
    taken = [key for key, took in answers if took]
    assert len(taken) == 3, taken  # the total, of 64 tries on three keys at once
    assert max(taken.count(key) for key in set(taken)) <= 2


# -- long polls: leases that a live gateway renews and a dead one's let go --------------------

HOLDER = """
import sys, time
from prefect_gpu_budget.agents.throttle import RedisStore
slots = RedisStore(sys.argv[1], prefix=sys.argv[2]).slots("long-polls", 2, 16)
slots.lease_s = 2.0
assert slots.take("grant-1") and slots.take("grant-1")
print("held", flush=True)
time.sleep(600)
"""


def test_a_dead_gateways_long_polls_come_free_within_a_lease(shared):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER), REDIS_URL, shared.prefix],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        slots = shared.slots("long-polls", 2, 16)
        time.sleep(3.0)  # past its first lease: the live holder renewed it
        assert not slots.take("grant-1") and slots.take("grant-2")
        slots.give("grant-2")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    died = time.monotonic()
    while not slots.take("grant-1"):
        assert time.monotonic() - died < 10, "a dead gateway's slots never came free"
        time.sleep(0.05)
    assert time.monotonic() - died <= 3.5  # within its lease (2 s), give or take a busy machine
    slots.give("grant-1")
    assert shared.client.zcard(f"{slots._name}all") == 0 and slots._mine == {}


def test_given_slots_are_free_at_once_for_every_gateway(shared):
    here, there = shared.slots("long-polls", 2, 3), shared.slots("long-polls", 2, 3)
    assert [here.take(k) for k in ("a", "a")] == [True, True]
    assert [there.take(k) for k in ("a", "b", "c")] == [False, True, False]
    here.give("a")
    assert there.take("a") and not here.take("c")
    there.give("a"), there.give("b"), here.give("a")
    assert _keys(shared) == []  # nothing held, nothing kept


# -- Redis down: closed, fast, and said once --------------------------------------------------


def test_an_unreachable_redis_fails_closed_and_fast(caplog):
    down = RedisStore("redis://127.0.0.1:9/0", prefix=_prefix(), timeout_s=1.0)
    window, slots = down.window("bad-tokens", 10, 60.0), down.slots("long-polls", 2, 16)
    began = time.monotonic()
    for _ in range(100):
        assert window.full("192.0.2.1") and window.hit("192.0.2.1")
        assert window.retry_after("192.0.2.1") == RETRY_WHEN_DOWN_S
        assert not slots.take("grant-1")
        slots.give("grant-1")
    assert time.monotonic() - began < 2.0  # asked once, not once a call
    said = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(said) == 1, said


# -- the setting --------------------------------------------------------------------------------


def test_the_setting_chooses_where_the_door_counts(monkeypatch):
    from prefect_gpu_budget.agents.door import Door
    from prefect_gpu_budget.agents.throttle import RedisSlots, RedisWindow, Slots
    from prefect_gpu_budget.settings import GATEWAY_REDIS_URL_ENV, gateway_redis_url

    for unset in (None, "", "  "):
        if unset is None:
            monkeypatch.delenv(GATEWAY_REDIS_URL_ENV, raising=False)
        else:
            monkeypatch.setenv(GATEWAY_REDIS_URL_ENV, unset)
        assert gateway_redis_url() is None
        door = Door(ledger=None)  # type: ignore[arg-type]
        assert isinstance(door.callers.failures, Window) and isinstance(door.long_polls, Slots)
    monkeypatch.setenv(GATEWAY_REDIS_URL_ENV, "postgresql://u:hidden@db/0")
    with pytest.raises(ValueError, match=GATEWAY_REDIS_URL_ENV) as refused:
        gateway_redis_url()
    assert "hidden" not in str(refused.value)
    monkeypatch.setenv(GATEWAY_REDIS_URL_ENV, f" {REDIS_URL} ")
    assert gateway_redis_url() == REDIS_URL
    door = Door(ledger=None)  # type: ignore[arg-type]
    assert isinstance(door.callers.address_failures, RedisWindow)
    assert isinstance(door.long_polls, RedisSlots)
    assert door.callers.calls._name == f"{NAMESPACE}calls:"
    door.callers.calls.store.client.close()
