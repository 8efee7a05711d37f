"""Channel: bounded, FIFO, end-of-stream distinct from broken, batch receive, statistics."""

from __future__ import annotations

import asyncio

import pytest

from tandem.core.channel import BrokenChannel, ChannelClosed, EndOfStream, open_channel
from tests.conftest import run_virtual


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="'c'.*capacity"):
        open_channel("c", 0)


def test_send_waits_while_full_and_resumes_when_drained() -> None:
    async def scenario() -> None:
        tx, rx = open_channel("c", 2)
        await tx.send(1)
        await tx.send(2)
        blocked = asyncio.ensure_future(tx.send(3))
        await asyncio.sleep(1)
        assert not blocked.done()
        assert tx.statistics().waiting_senders == 1
        assert await rx.receive() == 1
        await asyncio.wait_for(blocked, 1)
        assert [await rx.receive(), await rx.receive()] == [2, 3]
        stats = rx.statistics()
        assert stats.max_depth == 2 and stats.depth == 0
        assert stats.items_sent == stats.items_received == 3
        assert stats.send_wait_s == pytest.approx(1.0)

    run_virtual(scenario())


def test_close_drains_then_ends_and_refuses_sends() -> None:
    async def scenario() -> None:
        tx, rx = open_channel("c", 4)
        await tx.send_many([1, 2, 3])
        tx.close()
        with pytest.raises(ChannelClosed, match="'c'"):
            await tx.send(4)
        assert [x async for x in rx] == [1, 2, 3]
        with pytest.raises(EndOfStream):
            await rx.receive_batch(2)

    run_virtual(scenario())


def test_close_wakes_a_waiting_receiver_with_end_of_stream() -> None:
    async def scenario() -> None:
        tx, rx = open_channel("c", 1)
        waiter = asyncio.ensure_future(rx.receive())
        await asyncio.sleep(0.1)
        tx.close()
        with pytest.raises(EndOfStream):
            await waiter

    run_virtual(scenario())


def test_abort_breaks_both_ends_and_chains_the_cause() -> None:
    async def scenario() -> None:
        tx, rx = open_channel("c", 1)
        await tx.send(1)
        sender = asyncio.ensure_future(tx.send(2))
        await asyncio.sleep(0.1)
        tx.abort(ValueError("upstream died"))
        with pytest.raises(BrokenChannel, match="upstream died"):
            await sender
        with pytest.raises(BrokenChannel) as info:
            await rx.receive()
        assert isinstance(info.value.__cause__, ValueError)

    run_virtual(scenario())


def test_receive_batch_takes_what_is_there_up_to_the_limit() -> None:
    async def scenario() -> None:
        tx, rx = open_channel("c", 10)
        await tx.send_many(range(5))
        assert await rx.receive_batch(3) == [0, 1, 2]
        assert await rx.receive_batch(3) == [3, 4]

    run_virtual(scenario())


def test_receive_batch_lingers_for_a_full_batch_but_not_past_its_timeout() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        tx, rx = open_channel("c", 10)

        async def trickle() -> None:
            for i in range(4):
                await tx.send(i)
                await asyncio.sleep(1.0)

        producer = asyncio.ensure_future(trickle())
        t0 = loop.time()
        assert await rx.receive_batch(3, linger_s=5.0) == [0, 1, 2]  # full after 2 s
        assert loop.time() - t0 == pytest.approx(2.0)
        t1 = loop.time()
        assert await rx.receive_batch(3, linger_s=0.5) == [3]  # timed out waiting for more
        assert loop.time() - t1 == pytest.approx(1.0 + 0.5)  # first item at 3 s, then the linger
        await producer

    run_virtual(scenario())


def test_a_cancelled_receiver_passes_its_wakeup_on() -> None:
    async def scenario() -> None:
        tx, rx = open_channel("c", 4)
        first = asyncio.ensure_future(rx.receive())
        second = asyncio.ensure_future(rx.receive())
        await asyncio.sleep(0.1)
        await tx.send(7)  # wakes `first` ...
        first.cancel()  # ... which is cancelled before it runs
        assert await asyncio.wait_for(second, 1) == 7

    run_virtual(scenario())
