"""The control plane's one-request-at-a-time lock hands over in the order it was asked for."""

from __future__ import annotations

import threading
from collections.abc import Callable

from rehearsal.controlplane import FairLock
from rehearsal.polling import wait_for


def _waiters(lock: FairLock, count: int) -> Callable[[], bool]:
    return lambda: len(lock._waiting) >= count


def test_waiters_get_the_lock_in_the_order_they_asked_and_it_is_re_entrant() -> None:
    # Given a lock held (twice, re-entered) by this thread, and three threads asking for it one after the other
    lock = FairLock()
    assert lock.acquire() and lock.acquire()
    order: list[int] = []

    def take(n: int) -> None:
        with lock:
            order.append(n)

    threads = [threading.Thread(target=take, args=(n,)) for n in range(3)]
    for n, thread in enumerate(threads):
        thread.start()
        wait_for(_waiters(lock, n + 1), f"thread {n} waiting")  # before the next one asks
    # When it is released as often as it was taken, then each waiter takes it in turn
    lock.release()
    assert order == []
    lock.release()
    for thread in threads:
        thread.join(5)
    assert order == [0, 1, 2]


def test_a_wait_that_times_out_leaves_the_queue() -> None:
    lock = FairLock()
    lock.acquire()
    refused = threading.Thread(target=lambda: order.append(lock.acquire(timeout=0.05)))
    order: list[bool] = []
    refused.start()
    refused.join(5)
    lock.release()
    assert order == [False]
    assert lock.acquire(timeout=0)
