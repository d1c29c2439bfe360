"""One local Ray cluster for many CPU-mode trainer launches, one after the other: the demo's runs
(``verl_oar.testbed.demo``) and a test session's (tests/e2e/conftest.py).

Each CPU-mode trainer run otherwise starts and stops a Ray cluster of its own (``ray.init()`` in
verl's ``run_ppo``). Here a holder process -- ``python -m verl_oar.cpu.ray_cluster``, a child of the caller --
starts one with ``ray.init`` (the resources a CPU run of ``--ranks`` ranks asks for: ``ray_resources``), prints its GCS
address, then answers ``leftovers`` on stdin with what is still alive in the cluster: actors,
placement groups, drivers and held resources of finished runs (a run must leave nothing behind that
the next run could see: verl's TransferQueue controller, for one, is a named actor in a fixed
namespace, so two runs must never share a cluster at the same time). Closing its stdin shuts the cluster down; nothing else on the machine is touched (no
``ray stop``, which would stop every Ray cluster of the user, other people's test runs included).

Trainer launches join the cluster through ``$VERL_OAR_RAY_ADDRESS`` (``verl_oar.cpu.overrides``) and
the cluster's ``$RAY_AUTH_MODE`` (``SharedRayCluster.env``); :func:`shared_cluster` sets them for a block of
launches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from verl_oar.cpu.overrides import RAY_ADDRESS_ENV, ray_resources

RESOURCES = ray_resources(1)
"""what a one-rank CPU run's own cluster has (``cpu_overrides``): one pretend GPU, 8 CPU slots for verl's actors"""
OBJECT_STORE_BYTES = 1 << 30
"""1 GiB: the CPU runs move a tiny model and batches of 16 rows (Ray's default would be 30% of memory)"""


class SharedRayCluster:
    """The holder process, seen from its caller."""

    def __init__(self, log: Path, ranks: int = 1):
        """Start the holder: a cluster with room for one run of up to ``ranks`` ranks at a time (``ray_resources``;
        a run of fewer ranks takes fewer pretend GPUs and leaves the rest free)."""
        ray_resources(ranks)  # a bad count is refused here, not in the holder
        env = dict(os.environ)
        # the workers must get CPU mode from each run's job (trainer_env), not from the cluster
        env.pop("VERL_PLATFORM", None)
        env.pop("RAY_ADDRESS", None)
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "verl_oar.cpu.ray_cluster", "--ranks", str(ranks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True, env=env, start_new_session=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"the shared Ray cluster did not start; its log: {log}\n{Path(log).read_text()[-3000:]}")
        started = json.loads(line)
        self.address = started["address"]
        self.env = {RAY_ADDRESS_ENV: self.address}
        """what a launch needs in its environment to join: the address, and the cluster's authentication
        mode (Ray >= 2.5x starts a local cluster with token authentication and stores the token in
        ~/.ray/auth_token; a driver that joins uses it only with ``RAY_AUTH_MODE=token``)"""
        if started["auth_mode"]:
            self.env["RAY_AUTH_MODE"] = started["auth_mode"]

    def leftovers(self) -> dict:
        """What finished runs left in the cluster ({} when nothing)."""
        self.proc.stdin.write("leftovers\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def wait_for_no_leftovers(self, patience_s: float = 60.0) -> dict:
        """Ray ends a finished driver's actors and placement groups asynchronously (seconds): wait up
        to ``patience_s`` for them to go; return what is still there then ({} when nothing)."""
        deadline = time.monotonic() + patience_s
        while True:
            left = self.leftovers()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(1.0)

    def stop(self) -> None:
        try:
            self.proc.stdin.close()  # the holder shuts Ray down and exits
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            from verl_oar.cpu.launch import stop_process_group

            stop_process_group(self.proc)
        self._log.close()


@contextmanager
def shared_cluster(log: Path, join_given: bool = True) -> Iterator[SharedRayCluster | None]:
    """One Ray cluster for the block's trainer launches. With ``join_given`` and ``$VERL_OAR_RAY_ADDRESS`` already
    set (a caller's cluster, a test session's), that one, as it is: yields None. Otherwise a new
    :class:`SharedRayCluster` (its holder's log at ``log``), whose ``env`` is in ``os.environ`` for the block; after
    the block, also on error, the environment is as it was and the cluster is stopped."""
    if join_given and os.environ.get(RAY_ADDRESS_ENV):
        yield None
        return
    cluster = SharedRayCluster(log)
    saved = {key: os.environ.get(key) for key in cluster.env}
    try:
        os.environ.update(cluster.env)
        yield cluster
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        cluster.stop()


def _leftovers(own_job: str) -> dict:
    import ray
    from ray._private import state

    out = {}
    actors = [
        f"{a.get('Name') or a['ActorClassName']} ({a['State']}, job {a['JobID']})"
        for a in state.actors().values()
        if a["State"] != "DEAD"
    ]
    if actors:
        out["actors"] = actors
    groups = [f"{g['name'] or pg_id} ({g['state']})" for pg_id, g in ray.util.placement_group_table().items()
              if g["state"] != "REMOVED"]
    if groups:
        out["placement_groups"] = groups
    drivers = [j["JobID"] for j in state.jobs() if not j["IsDead"] and j["JobID"] != own_job]
    if drivers:
        out["live_drivers"] = drivers
    total, free = ray.cluster_resources(), ray.available_resources()
    held = {k: total[k] - free.get(k, 0.0) for k in ("CPU", "GPU") if total.get(k, 0.0) - free.get(k, 0.0) > 1e-9}
    if held:
        out["held_resources"] = held
    return out


def _hold(ranks: int = 1) -> None:
    import ray

    ray.init(**ray_resources(ranks), object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False,
             log_to_driver=False)
    own_job = ray.get_runtime_context().get_job_id()
    address = ray.get_runtime_context().gcs_address
    print(json.dumps({"address": address, "auth_mode": os.environ.get("RAY_AUTH_MODE")}), flush=True)
    for line in sys.stdin:
        if line.strip() == "leftovers":
            print(json.dumps(_leftovers(own_job)), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Hold a local Ray cluster for CPU-mode runs (module docstring).")
    parser.add_argument("--ranks", type=int, default=1, help="room for runs of up to this many ranks (default 1)")
    _hold(parser.parse_args().ranks)
