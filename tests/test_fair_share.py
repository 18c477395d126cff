"""Fair shares of the KV pool (engine/fair_share.py), counted in blocks on plain stand-ins for sequences."""
from __future__ import annotations

from types import SimpleNamespace

from lamina.engine.fair_share import compute_shares, eviction_victims, fair_running_order


def _seq(rid: str, blocks: int, out: int = 1, max_tokens: int = 100):
    return SimpleNamespace(request_id=rid, block_table=list(range(blocks)), num_output_tokens=out,
                           max_tokens=max_tokens)


def test_shares_count_running_and_waiting_requests():
    running = [_seq("big", 10) for _ in range(6)]
    shares = compute_shares(running, [_seq("small", 0)], 64)
    assert shares.fair == 32 and shares.held == {"big": 60} and shares.over("big") == 28
    assert shares.over("small") == -32


def test_running_order_puts_the_biggest_holder_last_keeping_each_requests_order():
    running = [_seq("big", 10), _seq("mid", 3), _seq("big", 10), _seq("small", 1)]
    order = fair_running_order(running, compute_shares(running, [], 30))  # fair: 10 each
    assert [s.request_id for s in order] == ["mid", "small", "big", "big"]
    assert order[2] is running[0] and order[3] is running[2]


def test_victims_are_the_newest_of_the_biggest_holder_down_to_its_share():
    running = [_seq("big", 8) for _ in range(8)] + [_seq("mid", 6), _seq("mid", 6)]
    shares = compute_shares(running, [_seq("small", 0)], 90)  # fair 30; big holds 64, mid 12
    victims = eviction_victims(running, shares, "small", 20)
    assert victims == running[5:8][::-1]  # 24 blocks from big, newest first; big keeps 40 >= 30
    assert eviction_victims(running, shares, "small", 40) == []  # big can give only 32 and keep its share
    assert eviction_victims(running, shares, "big", 1) == []  # over its share: takes nothing


def test_one_sequence_requests_and_finishing_sequences_are_never_victims():
    running = [_seq("a", 20), _seq("b", 20, out=100, max_tokens=100), _seq("b", 1)]
    shares = compute_shares(running, [_seq("c", 0)], 30)
    assert eviction_victims(running, shares, "c", 1) == [running[2]]
    assert eviction_victims(running, shares, "c", 2) == []  # not a's only sequence, nor b's last-token one


def test_slot_victim_takes_from_the_request_running_the_most_down_to_its_share():
    from lamina.engine.fair_share import slot_victim

    running = [_seq("big", 2) for _ in range(3)] + [_seq("mid", 2)]
    assert slot_victim(running, "new", 3, 4) is running[2]  # share 4/3: big keeps 2 >= 1.33
    assert slot_victim(running, "mid", 2, 4) is running[2]  # share 2: mid may have a second slot
    even = [_seq("big", 2), _seq("big", 2), _seq("mid", 2), _seq("mid", 2)]
    assert slot_victim(even, "mid", 2, 4) is None  # a third would put mid over its share
    assert slot_victim(running[2:], "new", 3, 2) is None  # big's only slot: nothing to take
