"""The pure priority queue: order, aging, bounds, removal and positions."""

from __future__ import annotations

import pytest

from gateway.priority_queue import PriorityQueue, QueueEntry

FREE, PLUS, ENTERPRISE = 0, 1, 2


def entry(request_id: str, priority: int, arrival_s: float, num_tokens: int = 10) -> QueueEntry:
    return QueueEntry(request_id, priority, arrival_s, num_tokens)


def drain(queue: PriorityQueue) -> list[str]:
    order = []
    while (head := queue.pop_head()) is not None:
        order.append(head.request_id)
    return order


def test_higher_priority_pops_first_and_arrival_order_holds_within_a_priority():
    queue = PriorityQueue(100, 10_000, aging_s=10.0)
    for request_id, priority, arrival_s in [
        ("f1", FREE, 0.0),
        ("e1", ENTERPRISE, 1.0),
        ("p1", PLUS, 2.0),
        ("e2", ENTERPRISE, 3.0),
        ("f2", FREE, 4.0),
    ]:
        queue.push(entry(request_id, priority, arrival_s))
    assert drain(queue) == ["e1", "e2", "p1", "f1", "f2"]


def test_a_free_request_that_waited_long_enough_passes_newer_enterprise_requests():
    queue = PriorityQueue(100, 10_000, aging_s=10.0)
    queue.push(entry("free", FREE, 0.0))
    queue.push(entry("early", ENTERPRISE, 19.0))  # within 2 levels * 10 s: still ahead
    queue.push(entry("late", ENTERPRISE, 21.0))  # more than 20 s later: behind the free one
    assert drain(queue) == ["early", "free", "late"]
    assert queue.effective_priority(entry("x", FREE, 0.0), now_s=25.0) == pytest.approx(2.5)


def simulate_flood(aging_s: float, horizon_s: int) -> float | None:
    """3 enterprise arrivals and 2 admissions per second; one free request at t=5.

    Returns when the free request was admitted, or None if it never was.
    """
    queue = PriorityQueue(100_000, 10**9, aging_s=aging_s)
    for t in range(horizon_s):
        for i in range(3):
            queue.push(entry(f"e{t}.{i}", ENTERPRISE, float(t)))
        if t == 5:
            queue.push(entry("free", FREE, float(t)))
        for _ in range(2):
            if queue.pop_head().request_id == "free":
                return float(t)
    return None


def test_aging_bounds_a_free_requests_wait_under_a_flood_of_enterprise_traffic():
    admitted_s = simulate_flood(aging_s=10.0, horizon_s=1000)
    # Ahead of it: the 5 s backlog plus 20 s (2 levels * aging_s) of enterprise arrivals,
    # i.e. at most 3 * 26 entries served at 2 per second.
    assert admitted_s is not None
    assert admitted_s - 5.0 <= 3 * 26 / 2
    assert simulate_flood(aging_s=0.0, horizon_s=1000) is None  # without aging it starves


def test_bounds_on_waiting_requests_and_tokens_are_kept():
    queue = PriorityQueue(max_waiting_requests=2, max_waiting_tokens=100, aging_s=10.0)
    queue.push(entry("a", FREE, 0.0, 60))
    assert not queue.has_room(41)
    with pytest.raises(ValueError, match="no room"):
        queue.push(entry("b", FREE, 0.0, 41))
    queue.push(entry("b", FREE, 0.0, 40))
    assert not queue.has_room(0)
    with pytest.raises(ValueError, match="no room"):
        queue.push(entry("c", ENTERPRISE, 0.0, 0))
    assert (queue.num_waiting, queue.num_waiting_tokens) == (2, 100)


def test_remove_releases_an_entry_and_its_tokens_exactly_once():
    queue = PriorityQueue(10, 1000, aging_s=10.0)
    queue.push(entry("a", FREE, 0.0, 30))
    queue.push(entry("b", FREE, 1.0, 20))
    assert queue.remove("a").request_id == "a"
    assert queue.remove("a") is None
    assert (queue.num_waiting, queue.num_waiting_tokens) == (1, 20)
    assert drain(queue) == ["b"]
    assert queue.num_waiting_tokens == 0


def test_a_request_id_pushed_again_after_removal_pops_once():
    queue = PriorityQueue(10, 1000, aging_s=10.0)
    queue.push(entry("a", FREE, 0.0))
    queue.remove("a")
    queue.push(entry("a", ENTERPRISE, 5.0))
    assert [e.priority for e in iter(queue.pop_head, None)] == [ENTERPRISE]


def test_a_request_id_already_waiting_is_refused():
    queue = PriorityQueue(10, 1000, aging_s=10.0)
    queue.push(entry("a", FREE, 0.0))
    with pytest.raises(ValueError, match="already queued"):
        queue.push(entry("a", FREE, 1.0))


def test_position_counts_the_entries_ahead():
    queue = PriorityQueue(10, 1000, aging_s=10.0)
    queue.push(entry("f", FREE, 0.0))
    queue.push(entry("p", PLUS, 1.0))
    queue.push(entry("e", ENTERPRISE, 2.0))
    assert [queue.position(r) for r in ("e", "p", "f", "missing")] == [1, 2, 3, None]
    assert queue.num_ahead(PLUS, 1.5) == 2  # behind e and p, ahead of f
    queue.remove("e")
    assert queue.position("f") == 2


def test_many_removals_keep_the_order_right():
    queue = PriorityQueue(10_000, 10**9, aging_s=10.0)
    for i in range(2000):
        queue.push(entry(f"r{i}", i % 3, float(i)))
    for i in range(0, 2000, 2):
        queue.remove(f"r{i}")
    assert queue.num_waiting == 1000
    popped = drain(queue)
    assert len(popped) == 1000 and all(int(r[1:]) % 2 == 1 for r in popped)
    keys = [queue.sort_key(int(r[1:]) % 3, float(r[1:])) for r in popped]
    assert keys == sorted(keys)


def test_the_tail_is_the_entry_served_last_and_first_skips_ineligible_entries():
    queue = PriorityQueue(10, 1000, aging_s=10.0)
    queue.push(entry("f", FREE, 0.0))
    queue.push(entry("e", ENTERPRISE, 5.0))
    queue.push(entry("p", PLUS, 9.0))
    assert [e.request_id for e in queue] == ["e", "p", "f"]
    assert queue.peek_tail().request_id == "f"
    assert queue.first(lambda e: e.priority < ENTERPRISE).request_id == "p"
    assert not queue.goes_before(queue.peek_tail(), ENTERPRISE, 15.0)  # f is at level 1.5
    assert queue.goes_before(queue.peek_tail(), ENTERPRISE, 25.0)  # f has aged past a new one


def test_peek_head_matches_pop_head():
    queue = PriorityQueue(10, 1000, aging_s=10.0)
    queue.push(entry("f", FREE, 0.0))
    queue.push(entry("e", ENTERPRISE, 0.0))
    queue.remove("e")
    assert queue.peek_head().request_id == "f"
    assert queue.pop_head().request_id == "f"
    assert queue.peek_head() is None
