"""Readers of share links without a key, on a fake clock: each client address's bucket of reads, its
share of the snapshot bytes being sent, how addresses count as clients (IPv6 by /64, a trusted
proxy not at all), and the state kept bounded however many addresses read."""

from __future__ import annotations

import pytest

from api.security import TrustedProxies
from api.share_readers import MAX_TRACKED_CLIENTS, SHARED_SENDING_MAX_BYTES_PER_CLIENT, Refusal, ShareReaders
from api.shares import MAX_SNAPSHOT_CHARS
from settings import ServerConfig, Settings
from tests.gateway.fakes import FakeClock


def test_a_clients_reads_are_held_to_its_bucket_and_refill_over_the_minute():
    clock = FakeClock()
    readers = ShareReaders(6, clock=clock)
    assert [readers.take_read("203.0.113.7") for _ in range(6)] == [0.0] * 6
    assert readers.take_read("203.0.113.7") == pytest.approx(10.0)  # one read refills in 60/6 s
    assert readers.take_read("198.51.100.1") == 0.0  # another address has its own bucket
    clock.advance(9.9)
    assert readers.take_read("203.0.113.7") == pytest.approx(0.1)  # a refused read takes nothing
    clock.advance(0.1)
    assert readers.take_read("203.0.113.7") == 0.0
    assert readers.take_read("203.0.113.7") > 0


def test_zero_reads_per_minute_and_a_trusted_proxy_have_no_read_limit():
    unlimited = ShareReaders(0)
    assert all(unlimited.take_read("203.0.113.7") == 0.0 for _ in range(1000))
    assert unlimited.num_clients == 0

    server = ServerConfig(trusted_proxies=["127.0.0.1", "10.0.0.0/8", "proxy.internal"])
    readers = ShareReaders(1, TrustedProxies.from_settings(Settings(server=server)))
    for peer in ("127.0.0.1", "10.1.2.3", "::ffff:10.1.2.3", "proxy.internal"):
        assert readers.client_of(peer) is None, peer
        assert readers.take_read(readers.client_of(peer)) == 0.0
        assert readers.take_read(readers.client_of(peer)) == 0.0
    assert readers.take_read("127.0.0.2") == 0.0
    assert readers.take_read("127.0.0.2") > 0  # not the proxy: limited


def test_an_ipv6_client_counts_by_its_64_and_a_mapped_ipv4_one_by_its_ipv4_address():
    readers = ShareReaders(1)
    assert readers.client_of("2001:db8:1:2::a") == readers.client_of("2001:db8:1:2:ffff::b") == "2001:db8:1:2::/64"
    assert readers.client_of("2001:db8:1:3::a") != readers.client_of("2001:db8:1:2::a")
    assert readers.client_of("::ffff:192.0.2.1") == "192.0.2.1"  # a dual-stack socket's IPv4 client
    assert readers.client_of("::ffff:192.0.2.2") == "192.0.2.2"  # not every IPv4 client in one /64
    assert readers.client_of(None) == "?"
    assert readers.take_read(readers.client_of("2001:db8:1:2::a")) == 0.0
    assert readers.take_read(readers.client_of("2001:db8:1:2::beef")) > 0  # the same /64's bucket


def test_many_addresses_cannot_grow_the_state_idle_ones_are_forgotten():
    clock = FakeClock()
    readers = ShareReaders(2, clock=clock)
    readers.max_clients = 100
    for i in range(1000):
        readers.take_read(f"10.0.{i // 256}.{i % 256}")
        assert readers.num_clients <= 100
    # The one read least lately is forgotten first: a client that keeps reading keeps its bucket.
    readers.take_read("192.0.2.9")
    readers.take_read("192.0.2.9")
    for i in range(98):
        readers.take_read(f"10.9.0.{i}")
    assert readers.take_read("192.0.2.9") > 0  # read again: now the latest
    for i in range(50):
        readers.take_read(f"10.9.1.{i}")
    assert readers.num_clients == 100
    assert readers.take_read("192.0.2.9") > 0, "a client still reading lost its bucket"
    clock.advance(60)  # every bucket full again: the same as none
    readers.prune()
    assert readers.num_clients == 0
    assert MAX_TRACKED_CLIENTS <= 100_000  # a few tens of MB at most


def test_one_client_holds_at_most_its_share_of_the_bytes_being_sent_and_others_still_read():
    readers = ShareReaders(120)
    readers.max_sending_bytes, readers.max_client_sending_bytes = 1000, 250
    assert readers.start_sending("192.0.2.1", 200) is None
    assert readers.start_sending("192.0.2.1", 100) is Refusal.CLIENT_SENDING  # 300 > its 250
    assert readers.start_sending("192.0.2.1", 50) is None
    for peer in ("192.0.2.2", "192.0.2.3", "192.0.2.4"):
        assert readers.start_sending(peer, 240) is None
    assert readers.num_sending_bytes == 970
    assert readers.start_sending("192.0.2.5", 100) is Refusal.ALL_SENDING  # the bound on all still holds
    readers.stop_sending("192.0.2.1", 200)
    assert readers.sending_bytes_of("192.0.2.1") == 50
    assert readers.start_sending("192.0.2.5", 100) is None
    for peer, num_bytes in (("192.0.2.1", 50), ("192.0.2.2", 240), ("192.0.2.3", 240), ("192.0.2.4", 240)):
        readers.stop_sending(peer, num_bytes)
    readers.stop_sending("192.0.2.5", 100)
    assert readers.num_sending_bytes == 0 and readers.sending_bytes_of("192.0.2.1") == 0


def test_a_clients_first_snapshot_always_fits_its_share_and_the_default_share_holds_the_largest():
    readers = ShareReaders(120)
    readers.max_client_sending_bytes = 10
    assert readers.start_sending("192.0.2.1", 500) is None  # nothing of its own in flight: only the bound on all
    assert readers.start_sending("192.0.2.1", 1) is Refusal.CLIENT_SENDING
    assert readers.start_sending(None, 500) is None  # a trusted proxy's readers: the bound on all only
    assert readers.start_sending(None, 500) is None
    assert 4 * MAX_SNAPSHOT_CHARS < SHARED_SENDING_MAX_BYTES_PER_CLIENT  # 4 UTF-8 bytes a character at most
