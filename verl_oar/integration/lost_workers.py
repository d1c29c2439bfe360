"""When a run fails after losing a rank's Ray worker or a node, name the lost ranks and nodes.

verl extension point: the OAR trainer (``trainer.OARTrainerSync``) wraps verl's ``fit`` (verl 0.9.1's v1 trainer) in
:meth:`LostWorkerMixin.fit`; the lookups are Ray 2.60's GCS tables (``ray.nodes()``, ``ray._private.state.actors``),
from the TaskRunner, which is connected to the cluster and needs no dashboard.

Why: verl's driver raises the first error it gets from a worker group's futures. When a rank's worker process dies
mid-step, that is usually the dead actor's ``ActorDiedError``, which names it. When a whole node is lost, the first
error is often a surviving rank's collective failing instead (gloo: ``Connection closed by peer [127.0.0.1]:47775.
This is typically caused by a remote worker crashing``), which names neither the rank nor the node
(tests/e2e/test_two_nodes_on_cpu.py). So, when ``fit`` fails with an error that looks like a lost peer
(:func:`looks_lost`), the trainer asks Ray which of its worker groups' actors are dead and which nodes are gone,
waiting up to ``PATIENCE_S`` for Ray to notice (Ray declares a node dead after its health checks fail, about 15 s
after the node went), and raises :class:`LostWorkerError` naming them, from the original error. Any other error is
re-raised as it is, after one immediate look (no wait). A run of verl's own trainer (a non-token estimator) is left
as verl runs it.
"""

from __future__ import annotations

import sys
import time

PATIENCE_S = 45.0
"""how long to wait for Ray to report the lost worker or node (its node health check: 5 misses 3 s apart, by default)"""
LOST_PEER_TEXT = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer", "NCCL",
                  "ActorDiedError", "ActorUnavailableError", "NodeDiedError", "WorkerCrashedError")
"""what a worker's error says when a peer it talks to is gone (gloo, NCCL, Ray's own errors in a task's error text)"""


class LostWorkerError(RuntimeError):
    """A run that failed after the cluster lost some of its ranks' workers; the message names them."""


def looks_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it came from) is Ray's error for a dead actor, worker or node, or a collective's
    for a peer that went away."""
    import ray.exceptions as rex

    lost_types = tuple(getattr(rex, name) for name in ("RayActorError", "WorkerCrashedError", "NodeDiedError",
                                                        "ObjectLostError") if hasattr(rex, name))
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, lost_types) or any(text in str(exc) for text in LOST_PEER_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def lost_ranks(worker_groups: dict) -> tuple[list[str], dict[str, dict]]:
    """Now, from Ray's GCS: one line per rank of ``worker_groups`` (name -> verl ``RayWorkerGroup``) whose actor is
    dead or whose node is not alive, and the nodes that are not alive (node id -> ``ray.nodes()`` record)."""
    import ray
    from ray._private import state

    nodes = {n["NodeID"]: n for n in ray.nodes()}
    dead_nodes = {node_id: n for node_id, n in nodes.items() if not n.get("Alive", True)}
    lines, seen = [], set()
    for group, wg in worker_groups.items():
        for rank, handle in enumerate(getattr(wg, "workers", []) or []):  # RayWorkerGroup.workers (public)
            actor_id = handle._actor_id.hex()
            if actor_id in seen:  # verl's colocated roles share one worker group
                continue
            seen.add(actor_id)
            info = state.actors(actor_id=actor_id) or {}
            node_id = (info.get("Address") or {}).get("NodeID", "")
            if info.get("State") != "DEAD" and node_id not in dead_nodes:
                continue
            where = f"node {node_id}" + (" (lost: Ray reports it dead)" if node_id in dead_nodes else "")
            cause = _death_cause(info.get("DeathCause"))
            lines.append(f"rank {rank} of {group}: actor {info.get('Name') or actor_id}, pid {info.get('Pid')}, on "
                         f"{where}, {info.get('State', 'state unknown')}" + (f": {cause}" if cause else ""))
    return lines, dead_nodes


def _death_cause(cause) -> str:
    """The first line of Ray's error message in an actor's death cause (an ``ActorDeathCause`` proto), or ''."""
    if cause is None:
        return ""
    try:
        context = getattr(cause, cause.WhichOneof("context"))
        message = getattr(context, "error_message", "") or ""
    except Exception:  # noqa: BLE001 - an older or newer proto: no cause rather than no report
        return ""
    first = message.strip().split(". ")[0].strip().removesuffix(".")
    return first[:200]


def report(worker_groups: dict, exc: BaseException, *, patience_s: float = PATIENCE_S) -> str | None:
    """The message naming what the run lost, or None when Ray reports nothing lost (after waiting up to
    ``patience_s`` when ``exc`` looks like a lost peer, at once otherwise)."""
    deadline = time.monotonic() + (patience_s if looks_lost(exc) else 0.0)
    while True:
        try:
            lines, dead_nodes = lost_ranks(worker_groups)
        except Exception as lookup:  # noqa: BLE001 - a diagnosis must never hide the run's own error
            print(f"[verl-oar] could not ask Ray which workers were lost: {lookup!r}", file=sys.stderr, flush=True)
            return None
        if lines or dead_nodes or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if not lines and not dead_nodes:
        return None
    text = str(exc).strip()
    first = text.splitlines()[-1].split(". ")[0][:200] if text else type(exc).__name__
    nodes = "; ".join(f"node {node_id} ({n.get('NodeManagerAddress', '?')})" for node_id, n in dead_nodes.items())
    return ("[verl-oar] the run failed after losing Ray workers of its ranks:\n  " + "\n  ".join(lines or ["(none)"])
            + (f"\n  nodes Ray reports dead: {nodes}" if nodes else "")
            + f"\nverl's error (above): {first}\nResume from the last checkpoint once the cluster is whole again "
            "(trainer.resume_mode=auto reads latest_checkpointed_iteration.txt in trainer.default_local_dir).")


class LostWorkerMixin:
    """Mixed into the OAR trainer: ``fit`` re-raises a failure after lost workers as :class:`LostWorkerError`."""

    def fit(self, *args, **kwargs):
        try:
            return super().fit(*args, **kwargs)
        except Exception as exc:
            groups = {name.removesuffix("_wg"): wg for name, wg in vars(self).items()
                      if name.endswith("_wg") and wg is not None}
            message = report(groups, exc)
            if message is None:
                raise
            print(message, file=sys.stderr, flush=True)
            raise LostWorkerError(message) from exc
