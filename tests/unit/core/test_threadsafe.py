"""A worker thread hands values to a loop, and learns when that loop has gone."""

from __future__ import annotations

import asyncio
import threading

from tandem.core.threadsafe import post_to_loop


def test_a_value_posted_from_a_thread_runs_on_the_loop() -> None:
    async def main() -> tuple[bool, int]:
        loop = asyncio.get_running_loop()
        got: asyncio.Future[int] = loop.create_future()
        posted: list[bool] = []
        thread = threading.Thread(target=lambda: posted.append(post_to_loop(loop, got.set_result, 7)))
        thread.start()
        value = await got
        thread.join()
        return posted[0], value

    posted, value = asyncio.run(main())
    assert posted is True
    assert value == 7


def test_a_closed_loop_is_reported_not_raised() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    calls: list[int] = []
    assert post_to_loop(loop, calls.append, 1) is False
    assert calls == []
