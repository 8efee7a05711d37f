"""How torch's intra-op thread count behaves across Python threads on this build, and the budget helper."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from tandem.engines.shared.threads import apply_thread_budget, budgeted_executor


@pytest.fixture
def restore_main_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _in_new_thread(fn: object) -> dict[str, int]:
    seen: dict[str, int] = {}

    def body() -> None:
        seen.update(fn())  # type: ignore[operator]

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return seen


def test_set_num_threads_is_per_thread_but_sets_the_default_for_new_threads(restore_main_threads: None) -> None:
    torch.set_num_threads(2)  # the main thread has initialised its own setting

    def worker() -> dict[str, int]:
        apply_thread_budget(1)
        return {"worker": torch.get_num_threads()}

    assert _in_new_thread(worker) == {"worker": 1}
    # Per thread: the worker's budget did not shrink the main thread's pool ...
    assert torch.get_num_threads() == 2
    # ... but a fresh thread starts from the last value set anywhere in the process, which is
    # why every engine worker applies its own budget before any torch work.
    assert _in_new_thread(lambda: {"fresh": torch.get_num_threads()}) == {"fresh": 1}


def test_budgeted_executor_applies_the_budget_in_its_worker(restore_main_threads: None) -> None:
    torch.set_num_threads(2)
    executor = budgeted_executor("test-budget", 1)
    try:
        assert executor.submit(torch.get_num_threads).result() == 1
        torch.set_num_threads(2)  # a later change elsewhere does not reach the running worker
        assert executor.submit(torch.get_num_threads).result() == 1
    finally:
        executor.shutdown(wait=True)
    assert torch.get_num_threads() == 2


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="thread budget"):
        apply_thread_budget(0)
