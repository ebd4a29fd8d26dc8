"""Rank 0 learns at once that a peer's process is gone: one plain TCP connection per peer, beside the heartbeat.

The heartbeat (job/train/distributed/group.py ``Heartbeat``) finds a lost peer only once its counter has not moved for the peer
timeout (6 s): a third of the wait from a lost pod to a new group (issue #30). Most losses are a process that died
(SIGKILL, an OOM kill, a pod deleted, a node drained), and then the kernel closes its sockets: rank 0 can know at
once. So every rank > 0 holds one TCP connection to rank 0 for the round. Rank 0 listens on an ephemeral port on
all its addresses and publishes ``host:port`` under the round's store key ``liveness``; a peer dials the address it
already reaches rank 0's store at (the store's host, ``MASTER_ADDR`` under torchrun; the published host last),
reads the nonce rank 0 sends on each connection, and answers with one line, ``biggraph-liveness <round> <rank>
<mac>``, the MAC over the round, the rank and that nonce under the group's secret (job/train/distributed/auth.py):
a connection of another round, a rank outside the group, a forged hello or one replayed from another connection
(the round id is logged, the secret is not) is refused, and so is a second connection of a connected rank.
Nothing else travels on it: it is not an RPC. Rank 0's watcher thread treats end-of-file or a reset on a peer's
connection as that peer's death and hands it to ``on_lost`` (``Heartbeat.lost``), which declares
it exactly as the heartbeat does (``dead/<rank>``, then ``check_peers``).

Both ways (issue 44): rank 0 also sends a byte (``PING``) on every peer's connection each ``ping_interval_s``, and a
peer that hears nothing for ``silent_after_s`` (the peer timeout), or finds the connection closed without rank 0's
goodbye, leaves the round (``on_rank0_lost``: the trainer exits with the failure budget's round-ended code, so that
torchrun re-forms the group without it). Before, a frozen or partitioned rank 0 was noticed only through the lock
client's 600 s and the store's 30 min. This needs nothing from the store, which lives in rank 0's process and
freezes with it.

What it does not replace: a frozen peer (SIGSTOP, a paused VM) keeps its connection open, and a machine that loses
power or its network closes nothing; the heartbeat still finds both after the peer timeout. A peer that leaves in
order (the end of a run: ``group.leave``) sends a goodbye byte before it closes, and rank 0 stops watching once it
leaves itself, so a normal exit is never a death. A peer that cannot connect (a firewall, a network policy) logs
that once and is watched by the heartbeat alone: the connection only makes detection faster, never required.
"""

from __future__ import annotations

import errno
import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from job.train.distributed import auth

logger = logging.getLogger("biggraph")

HELLO = b"biggraph-liveness"
BYE = b"B"  # leaving in order (a peer, or rank 0): what follows (end-of-file) is not a death
PING = b"P"  # rank 0 is alive (sent to every peer each ``ping_interval_s``)
CONNECT_TIMEOUT_S = 10.0  # a peer's dial of rank 0 (a dropped SYN retries for longer than that by itself)
MAX_HELLO = 256  # a hello's bytes: more without a newline is not ours
HELLO_DEADLINE_S = 10.0  # a connection that has not said who it is by then is closed
MAX_PENDING = 64  # connections waiting to say who they are; beyond, the oldest is closed
ACCEPT_BACKOFF_S = 0.5  # out of descriptors (EMFILE): no accepting for this long
# rank 0 leaving: how long ``close`` waits for the watcher's goodbyes before the process exits (an exit closes the
# sockets without one: every peer reads rank 0's death, exit 76). 5 s was outlasted by a watcher starved under load.
LEAVE_JOIN_S = 60.0


def liveness_key(round_id: str) -> str:
    """The store key under which rank 0 publishes its listener (``round_key``'s form: dies with the round)."""
    return f"biggraph/{round_id}/liveness"


class Liveness:
    """One rank's end of the round's liveness connections: rank 0 listens and watches, a peer connects and holds.

    Rank 0: ``listen`` (before the collective that ends ``init_distributed``, so that every peer finds the address
    once it is through), then ``start`` with ``on_lost``. A peer: ``start``, which reads the address and dials from a
    thread of its own (a dropped SYN must not hold its start-up). Either: ``close`` when it leaves in order.
    """

    def __init__(self, rank: int, world_size: int, round_id: str, *, ping_interval_s: float = 1.0,
                 silent_after_s: float = 6.0) -> None:
        self.rank = rank
        self.world_size = world_size
        self.round_id = round_id
        self.ping_interval_s = ping_interval_s
        self.silent_after_s = silent_after_s
        self.on_rank0_lost: Callable[[str], None] = lambda why: None  # a peer: rank 0 silent or gone (``start``)
        self.connected = threading.Event()  # a peer: its connection is up (tests wait on it)
        self.lost: list[int] = []  # rank 0: the peers whose connection closed without a goodbye, in order
        self.left: list[int] = []  # rank 0: the peers that said goodbye
        self.refused = 0  # rank 0: connections refused (no hello in time, forged, over the cap, EMFILE)
        self._listener: Optional[socket.socket] = None
        self._sock: Optional[socket.socket] = None  # a peer's connection to rank 0
        self._lock = threading.Lock()
        self._closed = False
        self._wake: Optional[tuple[socket.socket, socket.socket]] = None  # rank 0: wakes the watcher to stop
        self._thread: Optional[threading.Thread] = None

    # rank 0 ---------------------------------------------------------------------------------------------------
    def listen(self, store: Any, host: str) -> None:
        """Rank 0: listen on an ephemeral port on every address of this machine and publish ``host:port`` (``host``:
        what rank 0 knows itself as, only a peer's last resort). Publishes an empty value if it cannot listen, so
        that peers do not wait for it."""
        try:
            listener = server_socket(self.world_size)
        except OSError as err:
            logger.warning("rank 0: cannot listen for the peers' liveness connections (%s); lost peers are found by "
                           "the heartbeat alone", err)
            store.set(liveness_key(self.round_id), "")
            return
        self._listener, self._wake = listener, socket.socketpair()
        store.set(liveness_key(self.round_id), f"{host}:{listener.getsockname()[1]}")

    def _watch(self, on_lost: Callable[[int], None]) -> None:
        """Rank 0's watcher: accept (each connection gets a nonce to answer), read each hello, then wait for each
        identified connection's end, pinging the peers meanwhile. Bounded: at most ``MAX_PENDING`` connections
        without a hello (the oldest gives way), each dropped after ``HELLO_DEADLINE_S``, and on running out of
        descriptors (EMFILE) it stops accepting for ``ACCEPT_BACKOFF_S`` instead of spinning on a listener that
        stays readable. The listen backlog is the system's largest, so that a burst of connections is queued, not
        dropped (a dropped SYN is retried only after a second)."""
        assert self._listener is not None and self._wake is not None
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake[0], selectors.EVENT_READ)
        hellos: dict[socket.socket, _Pending] = {}  # connections that have not identified themselves yet
        peers: dict[socket.socket, int] = {}
        pinged = 0.0
        accepting_again: Optional[float] = None  # backing off after EMFILE: when to accept again
        try:
            while not self._closed:
                now = time.monotonic()
                if now - pinged >= self.ping_interval_s:
                    pinged = now
                    _send_all(peers, PING)
                self._expire_hellos(hellos, selector, now)
                if accepting_again is not None and now >= accepting_again:
                    accepting_again = None
                    selector.register(self._listener, selectors.EVENT_READ)
                for key, _ in selector.select(timeout=self.ping_interval_s):
                    sock: socket.socket = key.fileobj  # type: ignore[assignment]
                    if sock is self._wake[0]:  # leaving in order: the goodbyes are said below
                        return
                    if sock is self._listener:
                        if not self._accept(selector, hellos):
                            selector.unregister(self._listener)
                            accepting_again = time.monotonic() + ACCEPT_BACKOFF_S
                        continue
                    try:
                        data = sock.recv(MAX_HELLO)
                    except BlockingIOError:
                        continue
                    except OSError:  # reset: the peer's kernel closed it without an orderly end
                        data = b""
                    if sock in hellos:
                        pending = hellos.pop(sock)
                        identified = self._identify(sock, pending, data, set(peers.values()))
                        if identified is None:
                            if pending.refused:
                                selector.unregister(sock)
                                sock.close()
                            else:
                                hellos[sock] = pending
                            continue
                        rank, data = identified
                        peers[sock] = rank
                        if not data:
                            continue
                    rank = peers.pop(sock)
                    selector.unregister(sock)
                    sock.close()
                    if data:  # the goodbye (anything else a peer sends is not ours to judge: it is left alone)
                        self.left.append(rank)
                    elif not self._closed:
                        self._lost(rank, on_lost)
        finally:
            if self._closed:  # leaving in order, whether the wake or the loop's test saw it first (``close`` sets the
                # flag before it wakes: a plain close here made every peer read rank 0's death): the peers stop
                # watching, one whose hello is not read yet too
                for conn in [*peers, *hellos]:
                    _part(conn)
            for sock in [*hellos, *peers, self._wake[0]]:
                sock.close()
            selector.close()

    def _accept(self, selector: selectors.BaseSelector, hellos: dict[socket.socket, _Pending]) -> bool:
        """Accept one connection and send it its nonce; False when out of descriptors (back off)."""
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self._note_refused(f"out of file descriptors ({err.strerror}): not accepting for "
                                   f"{ACCEPT_BACKOFF_S:g} s")
                return False
            return True
        if len(hellos) >= MAX_PENDING:  # a flood of idle connections: the oldest gives way (a real peer says hello
            # within moments of connecting, so it outlasts a flood that would otherwise hold every place)
            oldest = min(hellos, key=lambda sock: hellos[sock].since)
            del hellos[oldest]
            selector.unregister(oldest)
            oldest.close()
            self._note_refused(f"{MAX_PENDING} connections already waited to say who they are: the oldest closed")
        conn.setblocking(False)
        nonce = secrets.token_hex(16)
        try:
            conn.send(nonce.encode() + b"\n")
        except OSError:
            conn.close()
            return True
        hellos[conn] = _Pending(nonce=nonce, since=time.monotonic())
        selector.register(conn, selectors.EVENT_READ)
        return True

    def _expire_hellos(self, hellos: dict[socket.socket, _Pending], selector: selectors.BaseSelector,
                       now: float) -> None:
        for sock in [sock for sock, pending in hellos.items() if now - pending.since > HELLO_DEADLINE_S]:
            del hellos[sock]
            self._note_refused(f"no hello within {HELLO_DEADLINE_S:g} s")
            selector.unregister(sock)
            sock.close()

    def _note_refused(self, why: str) -> None:
        """Log a refused connection: the first few, then one in every thousand (a flood must not fill the log)."""
        self.refused += 1
        if self.refused <= 5 or self.refused % 1000 == 0:
            logger.info("rank 0: refused a liveness connection (%d so far): %s", self.refused, why)

    def _lost(self, rank: int, on_lost: Callable[[int], None]) -> None:
        self.lost.append(rank)
        logger.warning("rank %d's liveness connection to rank 0 closed without a goodbye: its process is gone; "
                       "declaring it dead", rank)
        try:
            on_lost(rank)
        except Exception:  # the store is gone with the round: the main thread fails by itself
            logger.debug("rank %d: could not declare it dead", rank, exc_info=True)

    def _identify(self, sock: socket.socket, pending: _Pending, data: bytes,
                  connected: set[int]) -> Optional[tuple[int, bytes]]:
        """(rank, the bytes after its hello's line) of a connection whose hello is complete, of this round, answers
        its nonce under the group's secret (job/train/distributed/auth.py) and names a peer not yet connected. None:
        still incomplete (``data`` kept in ``pending``), or refused (``pending.refused``; the caller closes it)."""
        buffer = pending.buffer = pending.buffer + data
        if b"\n" not in buffer:
            if data and len(buffer) <= MAX_HELLO:
                return None
            refused = "no hello" if buffer else "it closed before it said which rank it is"
        else:
            line, rest = buffer.split(b"\n", 1)
            parts = line.decode(errors="replace").split(" ")
            rank = int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else -1
            if parts[0] != HELLO.decode() or parts[1:2] != [self.round_id]:
                refused = f"not of round {self.round_id} ({line[:80]!r})"
            elif not 0 < rank < self.world_size:
                refused = f"rank {parts[2] if len(parts) > 2 else '?'} is not a peer of a group of {self.world_size}"
            elif not auth.verify(parts[3], "liveness", self.round_id, str(rank), pending.nonce):
                refused = f"rank {rank}'s hello does not answer its nonce under the group's secret (forged or replayed)"
            elif rank in connected:
                refused = f"rank {rank} is connected already"
            else:
                return rank, rest
        pending.refused = True
        try:
            address = sock.getpeername()
        except OSError:
            address = "?"
        self._note_refused(f"from {address}: {refused}")
        return None

    # a peer -----------------------------------------------------------------------------------------------------
    def _connect(self, hosts: list[str], port: int) -> None:
        """A peer's dial of rank 0, from its own thread; holds the connection until ``close``."""
        errors = []
        for host in hosts:
            try:
                sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
            except OSError as err:
                errors.append(f"{host}:{port}: {err}")
                continue
            try:
                sock.settimeout(CONNECT_TIMEOUT_S)
                nonce, early = _read_line(sock)
                proof = auth.mac("liveness", self.round_id, str(self.rank), nonce)
                sock.sendall(b"%s %s %d %s\n" % (HELLO, self.round_id.encode(), self.rank, proof.encode()))
            except OSError as err:
                sock.close()
                errors.append(f"{host}:{port}: {err}")
                continue
            with self._lock:
                if self._closed:  # left in order while dialling
                    _goodbye(sock)
                    return
                self._sock = sock
            self.connected.set()
            logger.debug("rank %d: liveness connection to rank 0 at %s:%d", self.rank, host, port)
            if BYE in early:  # rank 0 left in order before it read this hello: its goodbye came with the nonce
                return
            self._hear_rank0(sock)
            return
        logger.warning("rank %d: cannot connect to rank 0's liveness listener (%s); rank 0 finds this rank's loss "
                       "through the heartbeat alone (BIGGRAPH_PEER_TIMEOUT)", self.rank, "; ".join(errors))

    def _hear_rank0(self, sock: socket.socket) -> None:
        """A peer: read rank 0's pings until it says goodbye or this rank leaves; silence for ``silent_after_s``, or
        the connection's end without a goodbye, is rank 0 lost (``on_rank0_lost``)."""
        try:
            sock.settimeout(self.silent_after_s)
        except OSError:  # closed already: this rank left in order while it dialled
            return
        while True:
            try:
                data = sock.recv(64)
                why = "" if data else "its liveness connection closed without a goodbye (its process is gone)"
            except TimeoutError:
                why = f"it sent nothing for {self.silent_after_s:g} s (frozen, stalled or cut off)"
            except OSError as err:
                why = f"its liveness connection failed ({err})"
            if self._closed or BYE in (data if not why else b""):
                return
            if why:
                logger.error("rank %d: rank 0 is lost: %s; leaving the round so that torchrun re-forms the group",
                             self.rank, why)
                self.on_rank0_lost(f"rank 0 is lost: {why}")
                return

    # both -------------------------------------------------------------------------------------------------------
    def start(self, store: Any, on_lost: Callable[[int], None], hosts: tuple[Optional[str], ...] = (),
              on_rank0_lost: Optional[Callable[[str], None]] = None) -> None:
        """Rank 0: watch the peers' connections, calling ``on_lost(rank)`` for each that closes without a goodbye.
        A peer: read rank 0's address from the store (published before the collective this follows) and connect to
        the first of ``hosts`` (the addresses it reaches rank 0's store at, in order) that answers, then the
        published host; then hear rank 0, calling ``on_rank0_lost(why)`` when it goes silent or away."""
        if on_rank0_lost is not None:
            self.on_rank0_lost = on_rank0_lost
        if self.rank == 0:
            if self._listener is not None:
                self._thread = threading.Thread(target=self._watch, args=(on_lost,), name="biggraph-liveness",
                                                daemon=True)
                self._thread.start()
            return
        published = store.get(liveness_key(self.round_id)).decode()
        if not published:
            logger.warning("rank %d: rank 0 has no liveness listener; its loss of this rank is found through the "
                           "heartbeat alone", self.rank)
            return
        own, _, port = published.rpartition(":")
        targets = list(dict.fromkeys(h for h in (*hosts, own) if h))
        self._thread = threading.Thread(target=self._connect, args=(targets, int(port)), name="biggraph-liveness",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Leave in order. A peer: a goodbye byte, then close (rank 0 reads the byte before the end of the stream, so
        this is not a death). Rank 0: stop watching (the group is leaving) and close every connection."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            _goodbye(sock)
        if self._wake is not None:
            self._wake[1].send(b"x")
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=LEAVE_JOIN_S)
            self._wake[1].close()
            if self._thread is None:  # never watched: the watcher would have closed its end
                self._wake[0].close()
        if self._listener is not None:
            self._listener.close()


@dataclass
class _Pending:
    """A connection to rank 0's listener that has not identified itself yet."""

    nonce: str  # sent on accept: its hello must answer it (a captured hello is worth nothing on another connection)
    since: float  # accepted at (monotonic): dropped after HELLO_DEADLINE_S
    buffer: bytes = b""
    refused: bool = False


def _read_line(sock: socket.socket) -> tuple[str, bytes]:
    """A peer: rank 0's nonce line (bounded: a listener that is not rank 0's gets no hello), and what came after it
    in the same reads: rank 0's goodbye when it left in order before it read this peer's hello (dropping it made the
    peer read the end of the stream as rank 0's death)."""
    data = b""
    while b"\n" not in data:
        chunk = sock.recv(64)
        if not chunk or len(data) > 128:
            raise OSError("no nonce from the listener")
        data += chunk
    line, rest = data.split(b"\n", 1)
    return line.decode(errors="replace"), rest


def _send_all(peers: dict[socket.socket, int], data: bytes) -> None:
    """Rank 0: ``data`` to every peer, never blocking (a full buffer: the peer is not reading; it has its own
    timeout), never failing (a peer gone: its end is read by the watcher)."""
    for sock in list(peers):
        try:
            sock.send(data)
        except OSError:
            pass


def _part(sock: socket.socket) -> None:
    """Rank 0 leaving in order: a goodbye that reaches the peer as a goodbye, never as a reset.

    Closing a TCP socket with bytes it never read (a hello that arrived after the watcher's last read) makes the
    kernel send a reset and drop what it had not sent yet: a goodbye held back by Nagle's algorithm was lost that
    way, and the peer took rank 0's orderly leaving for its death (exit 76; CI's test_startup). So: the goodbye,
    then a half-close that pushes it out at once with the end of the stream behind it, then every unread byte
    read, so that the close is a plain one. A reset after that (a peer writing to the closed socket) comes behind
    the goodbye, which the peer reads first."""
    try:
        sock.send(BYE)
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # the peer is gone, or its buffer is full: it has its own timeout
        pass
    try:
        while sock.recv(4096):
            pass
    except OSError:  # nothing more to read now (non-blocking), or reset
        pass


def _goodbye(sock: socket.socket) -> None:
    try:
        sock.sendall(BYE)
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # rank 0 is gone, or stopped watching first: nothing to tell it
        pass
    sock.close()


def server_socket(backlog: int = 0) -> socket.socket:
    """A listening socket on an ephemeral port on every address: IPv4 and IPv6 where the kernel has both (a pod's
    namespace may have IPv6 off), IPv4 otherwise. Also the hand-off's and the shards' listeners."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True,
                                        backlog=max(socket.SOMAXCONN, backlog))
        except OSError:
            pass
    return socket.create_server(("", 0), backlog=max(socket.SOMAXCONN, backlog))


def store_host(store: Any) -> Optional[str]:
    """The host a store client dials (a ``TCPStore``, possibly under ``PrefixStore``s): where rank 0 is reached."""
    while store is not None:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
    return None
