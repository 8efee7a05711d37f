"""The documentation tests' summary: how many examples ran and how many are marked not run."""

from __future__ import annotations

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    outcomes = {"passed": 0, "skipped": 0, "failed": 0}
    for outcome in outcomes:
        outcomes[outcome] = sum("test_examples.py::test_example[" in r.nodeid for r in terminalreporter.stats.get(outcome, []))
    if any(outcomes.values()):
        terminalreporter.write_line(
            f"documentation examples: {outcomes['passed']} executed, {outcomes['skipped']} marked not run, "
            f"{outcomes['failed']} failed"
        )
