"""terrapipe.comm.connect_ranks: every pair connected and verified in one collective call, a
wrong process behind an address passed over, a rank that never comes named (NOTE [connecting
ranks] in comm/sockets.py). Ranks are threads here, exchanging through a stand-in for an MPI
communicator's allgather; tests/ps runs the same calls between real processes and nodes."""

import socket
import threading

import pytest

from terrapipe.comm import CommError, connect_ranks, interface_addresses
from terrapipe.comm import sockets as tsockets


class ThreadComm:
    """``allgather`` among ``n`` threads; ``rewrite(viewer, entries)`` may change what one rank
    sees of the others."""

    def __init__(self, n, rewrite=None):
        self.n, self.rewrite = n, rewrite
        self.entries = [None] * n
        self.barrier = threading.Barrier(n)

    def allgather(self, rank, obj):
        self.entries[rank] = obj
        self.barrier.wait()
        seen = list(self.entries)
        return self.rewrite(rank, seen) if self.rewrite else seen


class RankView:
    def __init__(self, comm, rank):
        self.comm, self.rank = comm, rank

    def allgather(self, obj):
        return self.comm.allgather(self.rank, obj)


def _run_ranks(n, body):
    results, errors = [None] * n, [None] * n

    def run(r):
        try:
            results[r] = body(r)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    return results, errors


def _close_all(results):
    for res in results:
        if res:
            for sock in (*res[0].values(), *res[1].values()):
                sock.close()


@pytest.mark.parametrize("n", [2, 3, 5])
def test_every_pair_is_connected_both_ways_and_carries_bytes(n):
    comm = ThreadComm(n)
    results, errors = _run_ranks(n, lambda r: connect_ranks(
        RankView(comm, r), r, [p for p in range(n) if p != r], [p for p in range(n) if p != r], 20, "test"))
    assert errors == [None] * n
    try:
        for r in range(n):
            reached, accepted = results[r]
            assert sorted(reached) == sorted(accepted) == [p for p in range(n) if p != r]
        # What rank a sends on its connection to b arrives on b's connection from a.
        for a in range(n):
            for b in range(n):
                if a != b:
                    results[a][0][b].sendall(bytes([a, b]))
        for b in range(n):
            for a in range(n):
                if a != b:
                    sock = results[b][1][a]
                    sock.settimeout(10)
                    assert sock.recv(2) == bytes([a, b])
                    assert sock.gettimeout() == 10 and sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        _close_all(results)


def test_a_wrong_process_behind_an_address_is_passed_over(monkeypatch):
    """Rank 0 sees rank 1 on another host, behind two wrong listeners first: one that closes
    the connection (another program, or another rank refusing a nonce not its own) and one that
    never answers (moved past after ATTEMPT_S)."""
    monkeypatch.setattr(tsockets, "ATTEMPT_S", 0.3)
    closing, silent = socket.socket(), socket.socket()
    for s in (closing, silent):
        s.bind(("127.0.0.1", 0))
        s.listen(8)
    stop = threading.Event()

    def refuse():
        closing.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = closing.accept()
            except OSError:
                continue
            conn.close()

    refuser = threading.Thread(target=refuse)
    refuser.start()

    def rewrite(viewer, seen):
        if viewer == 0:
            host, port, addrs, nonce = seen[1]
            wrong = [closing.getsockname(), silent.getsockname()]
            seen = [seen[0], ("elsewhere", port, wrong + [("127.0.0.1", port)], nonce)]
        return seen

    comm = ThreadComm(2, rewrite)
    try:
        results, errors = _run_ranks(
            2, lambda r: connect_ranks(RankView(comm, r), r, [1 - r], [1 - r], 20, "t"))
        assert errors == [None, None]
        results[0][0][1].sendall(b"x")
        results[1][1][0].settimeout(10)
        assert results[1][1][0].recv(1) == b"x"
        _close_all(results)
    finally:
        stop.set()
        refuser.join()
        closing.close()
        silent.close()


def test_a_rank_that_never_comes_is_named_within_the_timeout():
    """Rank 0 expects rank 1, which reaches nobody; rank 1 tries an address where nothing
    listens: both fail naming the other."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    nowhere = dead.getsockname()
    dead.close()  # a port where nothing listens

    def rewrite(viewer, seen):
        if viewer == 1:
            host, port, addrs, nonce = seen[0]
            seen = [("elsewhere", nowhere[1], [nowhere], nonce), seen[1]]
        return seen

    comm = ThreadComm(2, rewrite)
    results, errors = _run_ranks(2, lambda r: connect_ranks(
        RankView(comm, r), r, [] if r == 0 else [0], [1] if r == 0 else [], 1.0, "ps tensor 7"))
    assert isinstance(errors[0], CommError) and "ps tensor 7" in str(errors[0])
    assert "rank 1 never connected" in str(errors[0])
    assert isinstance(errors[1], CommError) and f"rank 0 (tried {nowhere[0]}:{nowhere[1]})" in str(errors[1])


def test_interface_addresses_leave_out_loopback_and_name_a_missing_interface(monkeypatch):
    for addr in interface_addresses():
        assert not addr.startswith("127.")
        socket.inet_aton(addr)
    assert interface_addresses("lo") == ["127.0.0.1"]  # named: taken, loopback or not
    with pytest.raises(CommError, match="no-such-if0"):
        monkeypatch.setenv("TERRAPIPE_SOCKET_IFNAME", "no-such-if0")
        interface_addresses()


def test_an_answer_later_than_the_attempt_window_still_gives_one_connection(monkeypatch):
    """Regression: rank 1 answers rank 0's hello after rank 0 had moved on to its next address.
    Rank 1 took the first connection as verified while rank 0 had closed it, then refused rank
    0's next hello (rank 0 was no longer expected): rank 1 returned a dead socket and rank 0
    failed after the timeout. Now a connection counts on both sides only once the connecting
    rank has chosen it (NOTE [connecting ranks] 2)."""
    monkeypatch.setattr(tsockets, "ATTEMPT_S", 0.2)
    slow_once = threading.Event()
    original = tsockets._read_hello

    def late(conn, *args):
        if not slow_once.is_set():
            slow_once.set()
            threading.Event().wait(0.6)  # rank 1 busy: the answer comes after rank 0's window
        return original(conn, *args)

    monkeypatch.setattr(tsockets, "_read_hello", late)
    comm = ThreadComm(2)
    results, errors = _run_ranks(2, lambda r: connect_ranks(
        RankView(comm, r), r, [1] if r == 0 else [], [0] if r == 1 else [], 8, "t"))
    assert errors == [None, None]
    assert slow_once.is_set()
    try:
        results[0][0][1].sendall(b"y")
        results[1][1][0].settimeout(10)
        assert results[1][1][0].recv(1) == b"y"
    finally:
        _close_all(results)
