"""A check that fails on one rank's rows stops the importance pass on every rank, with its message.

Why: the pass runs on every rank over that rank's own rows, and its model calls are collectives (FSDP2's
all-gathers, ``engines.fsdp.lockstep``'s flags, verl's micro-batch count). A rank that raises alone leaves the
others waiting in their next collective: under NCCL a hang until the watchdog fires, not an error. So such a
check raises only where every rank arrives with no collective pending, after the ranks agree (one
``all_gather_object`` over the world of each rank's first error message, or None): :func:`raised_on_every_rank`
around what runs before the pass's first collective (the answer locator on the rank's responses), and
:meth:`RankErrors.deferred` for a check inside the pass (``core.hf.OutcomeHead.check``): the failing rank records
the error and goes on making the same calls as the others, up to :meth:`RankErrors.agree` at the pass's end.
Every rank then raises a RuntimeError naming the failing ranks and their original messages. Cost, with several
ranks: two ``all_gather_object`` of None per pass (the agreements before it and, on FSDP, after it). On one rank
(or without torch.distributed) nothing is gathered or deferred: the original exception is raised where it was.

Not covered (the rank raises alone, as before): an exception inside a model call, e.g. out of memory in a forward
or backward between two of its all-gathers (that rank cannot make the rest of the call's collectives); any other
exception after the pass's first collective that is not a deferred check (verl's own ``prepare_micro_batches``
assertion on a sequence past ``max_token_len_per_gpu``, raised before its micro-batch all-reduce, as in verl's own
log-prob pass; shape checks that fail alike on every rank); Megatron's in-pass checks (its pass gets the agreement
before the pass only); a rank's process dying.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class RankErrors:
    """This rank's first deferred error, raised on every rank by :meth:`agree`."""

    def __init__(self):
        self.error: Exception | None = None
        self.several = _several_ranks()

    def deferred(self, check: Callable) -> Callable:
        """``check`` that records its exception here instead of raising it (``check`` itself on one rank)."""
        if not self.several:
            return check

        def run(*args, **kwargs):
            try:
                return check(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - raised on every rank by agree()
                if self.error is None:
                    self.error = error
            return None

        return run

    def agree(self) -> None:
        """On every rank at the same point, no collective pending: raise if any rank recorded an error."""
        if not self.several:
            if self.error is not None:
                raise self.error
            return
        import torch.distributed as dist

        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, None if self.error is None else f"{type(self.error).__name__}: {self.error}")
        ranks: dict[str, list[str]] = {}  # each message once, with the ranks that raised it
        for rank, message in enumerate(gathered):
            if message is not None:
                ranks.setdefault(message, []).append(str(rank))
        if ranks:
            failed = "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(r)}: {m}" for m, r in ranks.items())
            raise RuntimeError(
                "verl-oar's importance pass stopped on every rank (so that none waits in a collective for a rank "
                f"that failed): {failed}"
            ) from self.error


@contextmanager
def raised_on_every_rank():
    """Run the block (no collective in it) on every rank; if it raised on any rank, raise on every rank."""
    errors = RankErrors()
    try:
        yield
    except Exception as error:
        if not errors.several:
            raise
        errors.error = error
    errors.agree()
