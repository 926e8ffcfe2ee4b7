"""Readers of share links without a key (api/shares.py): the snapshot bytes being sent to them, in
all and per client, and each client's bucket of reads. State and decisions only, on an injected
clock; api/shares.py turns a refusal into its answer (the API's 429 or 503, the page's).

A client is its address, an IPv6 one by its /64 (one host or household holds a whole /64), but for
a peer in server.trusted_proxies: every reader through it has its address, so no per-client limit
can tell them apart, and only the bound on all bytes being sent applies (rate-limit at the proxy).
"""

from __future__ import annotations

import enum
import ipaddress
import math
import time

import structlog

from api.security import TrustedProxies
from gateway.ratelimit import Clock, TokenBucket

log = structlog.get_logger(__name__)

# Snapshots' bytes being sent to readers without a key, all together: a reader that stops reading
# holds its snapshot until server.write_timeout_s, and without this bound so would every connection.
SHARED_SENDING_MAX_BYTES = 256 * 1024 * 1024
# One client's share of them, so that a few stalled readers at one address cannot refuse every
# other reader; more than one snapshot's bytes (api/shares.py MAX_SNAPSHOT_CHARS, 4 UTF-8 bytes a
# character at most), and a client's first snapshot in flight is never refused for it anyway.
SHARED_SENDING_MAX_BYTES_PER_CLIENT = SHARED_SENDING_MAX_BYTES // 4
# Clients whose read buckets are kept at most (some 200 bytes each): past it the one idle longest
# is forgotten, which only gives it a full bucket again.
MAX_TRACKED_CLIENTS = 65_536
_PRUNE_EVERY = 1024  # reads between sweeps that forget full buckets (the same as fresh ones)
_PERIOD_S = 60.0  # reads_per_minute refills the bucket in a minute
_IPV6_CLIENT_PREFIX = 64
LOG_EVERY_S = 5.0  # a limit that bites is logged at most this often (with the count in between)
_READS = "reads_per_minute"  # the read bucket's name in the log: its setting


class Refusal(enum.Enum):
    """Why a snapshot may not be sent now."""

    CLIENT_SENDING = "client_sending"  # the client's own snapshots in flight hold its share: 429
    ALL_SENDING = "all_sending"  # every reader's together hold the bound: 503


class ShareReaders:
    """Per-client read buckets and the snapshot bytes in flight, in all and per client."""

    def __init__(
        self, reads_per_minute: int, proxies: TrustedProxies | None = None, clock: Clock = time.monotonic
    ) -> None:
        self.reads_per_minute = reads_per_minute  # 0: no limit
        self.max_sending_bytes = SHARED_SENDING_MAX_BYTES
        self.max_client_sending_bytes = SHARED_SENDING_MAX_BYTES_PER_CLIENT
        self.max_clients = MAX_TRACKED_CLIENTS
        self.num_sending_bytes = 0
        self.proxies = proxies if proxies is not None else TrustedProxies()  # none: every peer is a client
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}  # least recently read first
        self._sending: dict[str, int] = {}  # only clients with bytes in flight
        self._num_reads = 0
        self._last_log_s: dict[str, float] = {}
        self._num_unlogged: dict[str, int] = {}

    @property
    def num_clients(self) -> int:
        """Clients whose read buckets are kept now."""
        return len(self._buckets)

    def client_of(self, peer: str | None) -> str | None:
        """The client a peer address counts as; None for a trusted proxy (no per-client limit)."""
        if self.proxies.has(peer):
            return None
        peer = peer or "?"
        try:
            ip = ipaddress.ip_address(peer)
        except ValueError:
            return peer
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # a dual-stack socket's IPv4 client: by its IPv4 address, not a shared /64
        if isinstance(ip, ipaddress.IPv6Address):
            return str(ipaddress.IPv6Network((ip, _IPV6_CLIENT_PREFIX), strict=False))
        return str(ip)

    def take_read(self, client: str | None) -> float:
        """0 when the client may read now (one read taken from its bucket); else the seconds until it may."""
        if client is None or self.reads_per_minute <= 0:
            return 0.0
        bucket = self._buckets.pop(client, None)
        if bucket is None:
            bucket = TokenBucket(self.reads_per_minute, self.reads_per_minute / _PERIOD_S, self._clock)
            while len(self._buckets) >= self.max_clients:
                del self._buckets[next(iter(self._buckets))]
        self._buckets[client] = bucket  # to the end: the most recently read
        wait_s = bucket.retry_after_s(1)
        if wait_s > 0:
            self._note(_READS, client)
            return wait_s
        bucket.take(1)
        self._num_reads += 1
        if self._num_reads % _PRUNE_EVERY == 0:
            self.prune()
        return 0.0

    def prune(self) -> None:
        """Forget full buckets: a fresh one is the same, so memory follows the clients reading lately."""
        for client in [c for c, bucket in self._buckets.items() if bucket.level >= bucket.capacity]:
            del self._buckets[client]

    def start_sending(self, client: str | None, num_bytes: int) -> Refusal | None:
        """Count `num_bytes` of a snapshot as being sent to `client` until stop_sending, or say why not."""
        held = self._sending.get(client, 0) if client is not None else 0
        refusal = None
        if held and held + num_bytes > self.max_client_sending_bytes:
            refusal = Refusal.CLIENT_SENDING  # its own doing: said before the bound on all
        elif self.num_sending_bytes + num_bytes > self.max_sending_bytes:
            refusal = Refusal.ALL_SENDING
        if refusal is not None:
            self._note(refusal.value, client)
            return refusal
        self.num_sending_bytes += num_bytes
        if client is not None:
            self._sending[client] = held + num_bytes
        return None

    def stop_sending(self, client: str | None, num_bytes: int) -> None:
        """The reader took the bytes, or its connection is gone."""
        self.num_sending_bytes -= num_bytes
        if client is None:
            return
        held = self._sending.pop(client, 0) - num_bytes
        if held > 0:
            self._sending[client] = held

    def sending_bytes_of(self, client: str | None) -> int:
        return self._sending.get(client, 0) if client is not None else 0

    def _note(self, limit: str, client: str | None) -> None:
        """Log a limit that bit: the first time, then at most every LOG_EVERY_S seconds."""
        now = self._clock()
        if now - self._last_log_s.get(limit, -math.inf) < LOG_EVERY_S:
            self._num_unlogged[limit] = self._num_unlogged.get(limit, 0) + 1
            return
        self._last_log_s[limit] = now
        log.warning(
            "share_read_limited",
            limit=limit,
            client=client or "trusted_proxy",
            num_sending_bytes=self.num_sending_bytes,
            num_since_last_log=self._num_unlogged.pop(limit, 0),
        )
