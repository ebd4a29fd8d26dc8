"""partition_handoff (issue 45; job/train/distributed/handoff.py, holders.py): a partition's published rows kept in the
memory of the rank that let it go, handed to its next holder over authenticated TCP or taken back from its own memory,
checked against the digest the lock server hands out; anything else reads the file.

Real TCPStore and real sockets on 127.0.0.1; the ranks are objects of this process. The exactly-once invariants with
hand-offs under a kill at every step: tests/test_lock_protocol.py (``..._handed_pod_to_pod_...``); a real group:
tests/test_distributed_prefetch.py (``test_two_ranks_hand_partitions_over_...``).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from job.train.distributed import auth, protocol
from job.train.distributed.handoff import PartitionHandoff
from job.train.distributed.holders import Holders
from job.train.distributed.protocol import Granted, Release, Reserved

KEY = ("node", 2)


@pytest.fixture
def pair() -> Iterator[list[PartitionHandoff]]:
    auth.reset_for_tests(b"s" * 32)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ends = [PartitionHandoff(rank=rank, round_id="r1", store=store, key=lambda name: f"r1/{name}", limit=2)
            for rank in (0, 1)]
    for end in ends:
        end.start()
    try:
        yield ends
    finally:
        for end in ends:
            end.close()
        auth.reset_for_tests(None)


def rows() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return torch.randn(7, 3, generator=generator), torch.rand(7, generator=generator)


def test_the_next_holder_receives_the_published_rows_byte_for_byte(pair: list[PartitionHandoff]) -> None:
    holder, asker = pair
    weight, sums = rows()
    digest = holder.keep(KEY, weight, sums, step=4)
    asker.hint([KEY], [(KEY[0], KEY[1], 0, digest)])
    got = asker.take(KEY, (7, 3), per_coordinate=False, shared=True)
    assert got is not None and got.step == 4 and got.received == weight.nbytes + sums.nbytes
    assert torch.equal(got.weight, weight) and torch.equal(got.optim_sum, sums) and got.weight.is_shared()
    assert (asker.stats.handed_in, holder.stats.handed_out, holder.stats.bytes_out) == (1, 1, got.received)
    # the CPU both ends spent (the keeper's digest, the sender's thread, the receiver's copy and check) is counted
    assert holder.stats.cpu_s > 0 and asker.stats.as_record()["handoff_cpu_s"] >= 0 and asker.stats.cpu_s > 0
    assert asker.take(KEY, (7, 3), per_coordinate=False, shared=True) is None  # a hint serves one read


def test_a_rank_takes_its_own_kept_rows_back_without_the_network_once(pair: list[PartitionHandoff]) -> None:
    holder, _ = pair
    weight, sums = rows()
    holder.keep(KEY, weight, sums, step=0)  # its own next read takes them unless a grant says otherwise
    got = holder.take(KEY, (7, 3), per_coordinate=False, shared=False)
    assert got is not None and got.weight.data_ptr() == weight.data_ptr() and got.received == 0 and holder.stats.kept_hits == 1
    assert holder.kept_bytes() == 0  # taken out: it trains them now, nobody is served them any more


def test_a_grant_naming_no_holder_makes_a_rank_read_the_file(pair: list[PartitionHandoff]) -> None:
    holder, _ = pair
    holder.keep(KEY, *rows(), step=0)
    holder.hint([KEY], [])  # another rank wrote it since: the kept rows are stale
    assert holder.take(KEY, (7, 3), per_coordinate=False, shared=False) is None


def test_rows_that_are_not_what_was_published_or_not_kept_are_refused(pair: list[PartitionHandoff]) -> None:
    holder, asker = pair
    weight, sums = rows()
    digest = holder.keep(KEY, weight, sums, step=1)
    weight[3, 1] += 1.0  # changed after publication (as a corrupted transfer would arrive): fails the digest
    asker.hint([KEY], [(KEY[0], KEY[1], 0, digest)])
    assert asker.take(KEY, (7, 3), per_coordinate=False, shared=False) is None
    asker.hint([KEY], [(KEY[0], KEY[1], 0, "another digest")])  # rows it does not keep: "not kept"
    assert asker.take(KEY, (7, 3), per_coordinate=False, shared=False) is None
    asker.hint([("node", 0)], [("node", 0, 0, digest)])  # a partition it does not keep at all
    assert asker.take(("node", 0), (7, 3), per_coordinate=False, shared=False) is None
    assert asker.stats.misses == 3 and asker.stats.handed_in == 0


def test_only_a_bucket_of_partitions_is_kept_the_oldest_dropped_first(pair: list[PartitionHandoff]) -> None:
    holder, asker = pair
    digests = {part: holder.keep(("node", part), *rows(), step=0) for part in range(3)}  # limit 2
    asker.hint([("node", 0)], [("node", 0, 0, digests[0])])
    assert asker.take(("node", 0), (7, 3), per_coordinate=False, shared=False) is None
    asker.hint([("node", 2)], [("node", 2, 0, digests[2])])
    assert asker.take(("node", 2), (7, 3), per_coordinate=False, shared=False) is not None


def test_a_request_without_the_groups_mac_gets_no_rows(pair: list[PartitionHandoff]) -> None:
    holder, asker = pair
    digest = holder.keep(KEY, *rows(), step=0)
    host, port = asker._address(0)
    with socket.create_connection((host, port), timeout=10) as sock:
        hello = sock.recv(200).decode()
        assert hello.startswith("biggraph-handoff ")
        ask = {"rank": 1, "type": KEY[0], "part": KEY[1], "digest": digest,
               "mac": auth.mac("handoff-ask", "r1", "1", KEY[0], str(KEY[1]), digest, "a replayed nonce")}
        sock.sendall(json.dumps(ask).encode() + b"\n")
        assert sock.recv(100) == b""  # closed, nothing sent
    assert holder.stats.handed_out == 0


def test_the_server_names_a_holder_only_while_its_rows_are_the_files() -> None:
    from job.types import Bucket

    gone: set[int] = set()
    holders = Holders({Bucket(0, 3): frozenset({("node", 0), ("node", 3)})}, gone=lambda: gone)
    bucket = Bucket(0, 3)
    assert holders.grant(bucket, skip=()) == ()
    holders.released(1, [("node", 0), ("node", 1)], [("node", 0, "d0"), ("node", 3, "d3")], written=False)  # 3: not released
    assert holders.grant(bucket, skip=()) == (("node", 0, 1, "d0"),)
    assert holders.grant(bucket, skip=[("node", 0)]) == ()  # the rank's own
    assert holders.grant(None, skip=()) == ()
    gone.add(1)  # its holder died
    assert holders.grant(bucket, skip=()) == ()
    gone.clear()
    holders.written([("node", 0)])  # another rank's write group makes new rows current
    assert holders.grant(bucket, skip=()) == ()
    holders.released(2, [("node", 0)], [("node", 0, "e0")], written=False)
    holders.released(1, [("node", 0)], [], written=True)  # a plain written release: new rows, none kept
    assert holders.grant(bucket, skip=()) == ()
    holders.released(2, [("node", 3)], [("node", 3, "e3")], written=False)
    following = Holders({bucket: frozenset({("node", 0), ("node", 3)})}, gone=lambda: gone)
    following.adopt(holders)  # the next pass's server, once this pass committed what the holders published
    assert following.grant(bucket, skip=()) == (("node", 3, 2, "e3"),)


def test_a_new_pass_keeps_the_rows_but_no_hint(pair: list[PartitionHandoff]) -> None:
    holder, asker = pair
    digest = holder.keep(KEY, *rows(), step=0)
    holder.new_pass()
    assert holder.take(KEY, (7, 3), per_coordinate=False, shared=False) is None  # its own hint went with the pass
    asker.hint([KEY], [(KEY[0], KEY[1], 0, digest)])  # the next pass's grant names it again
    assert asker.take(KEY, (7, 3), per_coordinate=False, shared=False) is not None


def test_kept_rows_and_holders_travel_in_sealed_messages_and_not_at_all_without_them() -> None:
    request = protocol.read_incoming(protocol.encode_request(
        protocol.Envelope(1), Release(keys=(KEY,), written=False, kept=((KEY[0], KEY[1], "d"),)), scope="s"), scope="s")
    assert protocol.decode_request(request) == Release(keys=(KEY,), written=False, kept=((KEY[0], KEY[1], "d"),))
    holders = ((KEY[0], KEY[1], 1, "d"),)
    for reply in (Granted(kind="bucket", holders=holders), Reserved(holders=holders)):
        raw = protocol.encode_reply(reply, scope="s")
        assert protocol.decode_reply(raw, type(reply), "next", scope="s").holders == holders
    assert "holders" not in protocol.unpack(protocol.encode_reply(Granted(kind="wait"), scope="s"))
    with pytest.raises(protocol.LockServerError, match="'holders'"):
        protocol.decode_reply(protocol.seal({"ok": True, "kind": "wait", "holders": [["node", "x", 1, "d"]]}, "s"),
                              Granted, "next", scope="s")


def test_a_rank_with_no_room_to_keep_names_itself_holder_of_nothing_but_still_takes() -> None:
    """A ``memory_budget`` whose buffer has no room beside a bucket's and the next one's partitions leaves the hand-off
    nothing to keep (``handoff_kept_partitions`` 0): that rank's releases name no holder (an asker sent to it would
    only be refused and read the file), and it still takes rows another rank keeps."""
    from job.checkpoint.write_groups import WriteGroup
    from job.model.scoring import Table

    auth.reset_for_tests(b"s" * 32)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    keeper = PartitionHandoff(rank=0, round_id="r1", store=store, key=lambda name: f"r1/{name}", limit=2)
    tight = PartitionHandoff(rank=1, round_id="r1", store=store, key=lambda name: f"r1/{name}", limit=0)
    for end in (keeper, tight):
        end.start()
    try:
        weight, sums = rows()
        group = WriteGroup.of(3, [KEY], {KEY: Table(weight, sums)})
        assert tight.keep_group(group, {KEY: 1}) == [] and tight.kept_rows(KEY) is None
        (kept,) = keeper.keep_group(group, {KEY: 1})
        tight.hint([KEY], [(KEY[0], KEY[1], 0, kept[2])])
        taken = tight.take(KEY, (7, 3), per_coordinate=False, shared=False)
        assert taken is not None and torch.equal(taken.weight, weight)
    finally:
        for end in (keeper, tight):
            end.close()
        auth.reset_for_tests(None)


def test_the_kept_partitions_take_only_the_budgets_unused_buffer_room() -> None:
    """Hand-offs on by default never make a ``memory_budget`` too small: the kept partitions are not a fixed cost
    beside the buffer but live in the room a distributed trainer's buffer does not use (it holds its bucket's and
    the next one's read ahead), two buckets' at most; a budget that held a group without hand-offs holds it with."""
    from job.config import parse_config
    from job.train.residency.budget import choose_capacity, handoff_kept_partitions

    base = {"entity_path": "/tmp/e", "edge_paths": ["/tmp/x"], "checkpoint_path": "/tmp/c", "dimension": 99,
            "entities": {"all": {"num_partitions": 16}}, "relations": [{"name": "r", "lhs": "all", "rhs": "all"}]}
    counts = {"all": [10_000] * 16}  # 4 MB a partition
    assert parse_config(base).partition_handoff  # on by default
    assert handoff_kept_partitions(parse_config(base), None) == 4  # no budget: two buckets' partitions
    for room, kept in ((40, 4), (9, 3), (6, 0), (4, 0)):
        config = parse_config({**base, "memory_budget": str(2**20 + room * 4_000_000)})
        capacity = choose_capacity(config, counts, distributed=True, processes=1, runtime_bytes=2**20)
        without = choose_capacity(parse_config({**base, "partition_handoff": False,
                                                "memory_budget": str(2**20 + room * 4_000_000)}),
                                  counts, distributed=True, processes=1, runtime_bytes=2**20)
        assert capacity == without  # the same buffer with and without hand-offs
        assert handoff_kept_partitions(config, capacity) == kept, (room, capacity)
