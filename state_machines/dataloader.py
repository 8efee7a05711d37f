"""The dataloader role: turns the prompt source into prompt groups, in order, under backpressure.

Each prompt gets its dataloader position as ``prompt_id`` (unique within a run, and the
checkpointable data position). The source may be endless: the channel's capacity keeps the
dataloader at most one channel ahead of generation, and the flow stops it at the end.

A resumed run restarts the source (deterministic for its seed) at the oldest prompt that was in
flight at the checkpoint: it emits those prompts again with their own ids, skips the ones trained
or dropped before, then every prompt from the data position on, so no prompt is skipped and none
is admitted twice.
"""

from __future__ import annotations

from tandem.core.records import PromptGroup
from tandem.state_machines.base import State, StateMachine

__all__ = ["DataloaderStateMachine"]


class DataloaderStateMachine(StateMachine):
    role = "dataloader"

    position = 0  # prompts emitted so far; the next prompt's id

    async def main(self) -> None:
        n = self.config.rollout.samples_per_prompt
        batch: list[PromptGroup] = []
        resumed = self.services.resumed
        start, again = (resumed.next_prompt_id, set(resumed.in_flight)) if resumed else (0, set())
        # The source jumps to the first position needed: the oldest in-flight prompt, if any.
        self.position = min(again, default=start)
        for item in self.services.components.prompts(self.config.run.seed, self.position):
            if self.position < start and self.position not in again:
                self.position += 1  # trained or dropped before the checkpoint
                continue
            self.set_state(State.RUNNING)
            batch.append(PromptGroup(self.position, item, n))
            self.position += 1
            if len(batch) == self.micro_batch_size:
                await self.emit(batch)
                self.items_done += len(batch)
                batch = []
        await self.emit(batch)
        self.items_done += len(batch)
        assert self.outbox is not None
        self.outbox.close()
