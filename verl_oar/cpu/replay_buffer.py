"""verl's v1 sync replay buffer, polling every 0.05 s instead of 2 s (CPU runs of tiny models).

verl 0.9.1's ``ReplayBuffer.sample`` sleeps ``poll_interval`` (2 s, not configurable) between checks
for finished rollouts, so a rollout step is rounded up to a multiple of 2 s. A tiny model's step
takes a few seconds, which makes that rounding a third of the step. This subclass only changes the
interval; it is chosen with verl's own extension point::

    trainer.v1.sampler.custom_sampler.path=pkg://verl_oar.cpu.replay_buffer
    trainer.v1.sampler.custom_sampler.name=QuickPollReplayBuffer

For verl's sync trainer mode only, and without DAPO's group filter (verl passes a custom sampler
neither the filter nor its batch sizes).
"""

from __future__ import annotations

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

POLL_INTERVAL_S = 0.05


class QuickPollReplayBuffer(ReplayBuffer):
    def __init__(self, *args, **kwargs) -> None:
        kwargs["poll_interval"] = POLL_INTERVAL_S
        super().__init__(*args, **kwargs)
