"""Equal model-call counts on every rank, so that FSDP2's per-call all-gathers meet across ranks.

Every forward of an FSDP2 model all-gathers each wrapped module's parameters over the ranks it is
sharded on (and a backward may gather them again), so the ranks must make the same sequence of
forwards and backwards. OAR-P's number of model calls depends on each rank's samples (and on its
first round in ``hierarchical`` mode); OAR-G makes no call on a micro-batch with nothing to score.

:class:`Lockstep` keeps them equal with a one-element all-reduce (MAX) over the group FSDP2 shards over
before every model call of a rank still working (:meth:`Lockstep.call`); a rank whose own calls are done
keeps answering 0 and, while any other rank still calls, makes a one-token padding forward
(:meth:`Lockstep.finish`), so that every rank's k-th forward meets every other rank's k-th forward.
:meth:`Lockstep.anyone` lets OAR-G agree, per micro-batch, whether anyone differentiates.

The group is FSDP2's own (:func:`shard_group`: verl's ``engine.device_mesh``, whose last dimension FSDP2
shards over; the world when it is 1-D, as without HSDP), so the flags and the all-gathers share one
communicator and are issued in the same order on every rank. Cost: one all-reduce of one element per
model call (no host sync), and a host sync per padding round and per OAR-G micro-batch.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class Lockstep:
    """The ranks of a process group agreeing, call by call, whether any of them still calls the model.

    Every rank must call :meth:`call` before each of its real model calls, :meth:`anyone` at the same
    points, and :meth:`finish` once at the end of the pass.
    """

    def __init__(self, device: Any, group=None):
        """``device``: where the flag lives (the accelerator under NCCL, the CPU under gloo);
        ``group``: the process group FSDP2 gathers over (None: the world)."""
        self.device = device
        self.group = group
        self.padded = 0
        """padding forwards this rank made (:meth:`finish`)"""

    def _all_reduce(self, value: int) -> torch.Tensor:
        import torch.distributed as dist

        flag = torch.full((1,), value, dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag

    def call(self) -> None:
        """Before one real model call: tell the others this rank still calls (no host sync)."""
        self._all_reduce(1)

    def anyone(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (every rank must ask, at the same point)."""
        return bool(self._all_reduce(int(bool(flag))).item())

    def finish(self, padding_forward: Callable[[], None]) -> None:
        """This rank's calls are done: answer 0 and run ``padding_forward`` (one forward of the whole
        model, no grad) for each call another rank still makes; returns when no rank calls."""
        while self._all_reduce(0).item():
            padding_forward()
            self.padded += 1


def shard_group(engine):
    """The process group FSDP2 all-gathers ``engine.module``'s parameters over: the last dimension of verl's
    ``engine.device_mesh`` (``fsdp``; with HSDP the mesh is (``ddp``, ``fsdp``)); None (the world) without a
    mesh."""
    mesh = getattr(engine, "device_mesh", None)
    if mesh is None:
        return None
    return mesh.get_group(mesh.ndim - 1)


class LockstepModule:
    """A model (``engine.module``) whose every call first passes :meth:`Lockstep.call`; any attribute
    (``forward``, ``config``, ...) is the wrapped model's. Wrapped around the module OAR-P's ``RowsModel``
    calls, so the count holds however many forwards a ``RowsModel`` call makes."""

    def __init__(self, module, lockstep: Lockstep):
        self._module = module
        self._lockstep = lockstep

    def __call__(self, *args, **kwargs):
        self._lockstep.call()
        return self._module(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_module"], name)


def padding_forward(engine) -> Callable[[], None]:
    """A minimal forward of ``engine.module``: one token, no grad, under the engine's autocast; it enters
    every FSDP2 module (verl wraps decoder layers, embeddings, output layer and root), so it issues the
    same all-gathers as a real forward."""
    from verl.utils.device import get_device_id

    from verl_oar.core.hf import accepts_logits_to_keep
    from verl_oar.engines.inputs import autocast_context

    module = engine.module
    slim = {"logits_to_keep": 1} if accepts_logits_to_keep(module) else {}

    def forward() -> None:
        device = get_device_id()
        ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        with torch.no_grad(), autocast_context(engine):
            module(input_ids=ids, position_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids),
                   use_cache=False, **slim)

    return forward
