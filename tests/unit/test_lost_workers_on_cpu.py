"""verl_oar/integration/lost_workers.py: a run that fails after losing a rank's worker names the lost rank, its pid
and node, read from Ray's GCS; other failures pass through as they are. The trainer runs are
tests/e2e/test_two_ranks_on_cpu.py (OAR-P's launch: a rank's worker killed) and tests/e2e/test_two_nodes_on_cpu.py (a
node lost)."""

from __future__ import annotations

import pytest

from verl_oar.integration import lost_workers

LOST_RANK_PROBE = """
import os, signal, time, ray
from verl_oar.integration import lost_workers
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20)

@ray.remote(num_cpus=0)
class Rank:
    def pid(self):
        return os.getpid()
    def work(self):
        time.sleep(60)

class WorkerGroup:  # what lost_workers reads of verl's RayWorkerGroup: its public workers
    def __init__(self, workers):
        self.workers = workers

ranks = [Rank.remote() for _ in range(2)]
pids = ray.get([r.pid.remote() for r in ranks])
group = WorkerGroup(ranks)
assert lost_workers.lost_ranks({"actor_rollout": group}) == ([], {})
futures = [r.work.remote() for r in ranks]
os.kill(pids[1], signal.SIGKILL)
try:
    ray.get(futures)
except Exception as exc:
    assert lost_workers.looks_lost(exc), repr(exc)
    # a colocated role shares the worker group: each rank is named once
    print("REPORT", lost_workers.report({"actor_rollout": group, "ref": group}, exc, patience_s=20))
print("PIDS", *pids)
ray.shutdown()
"""


def test_a_killed_ranks_worker_is_named_with_its_pid_and_node(monkeypatch):
    from _fresh_process import run_fresh

    for key in ("RAY_ADDRESS", "VERL_OAR_RAY_ADDRESS"):  # a Ray of its own, whatever cluster the session has
        monkeypatch.delenv(key, raising=False)
    process = run_fresh(LOST_RANK_PROBE, timeout=240)
    pids = next(line.split()[1:] for line in process.stdout.splitlines() if line.startswith("PIDS"))
    report = process.stdout.split("REPORT ", 1)[1]
    assert report.startswith("[verl-oar] the run failed after losing Ray workers of its ranks"), process.failure()
    lines = [line for line in report.splitlines() if line.strip().startswith("rank ")]
    assert len(lines) == 1 and lines[0].strip().startswith(f"rank 1 of actor_rollout: actor ") and \
        f"pid {pids[1]}, on node " in lines[0] and "DEAD: The actor is dead because its worker process has died" \
        in lines[0], report
    assert "trainer.resume_mode=auto" in report


LOST_NODE_PROBE = """
import os, time, ray
from ray.cluster_utils import Cluster
from verl_oar.integration import lost_workers
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                        "object_store_memory": 80 << 20})
node = cluster.add_node(num_cpus=1, resources={"rank_node": 1}, object_store_memory=80 << 20)
ray.init(address=cluster.address, log_to_driver=False)

@ray.remote(num_cpus=0, resources={"rank_node": 1})
class Rank:
    def pid(self):
        return os.getpid()

class WorkerGroup:
    def __init__(self, workers):
        self.workers = workers

rank = Rank.remote()
pid = ray.get(rank.pid.remote())
cluster.remove_node(node, allow_graceful=False)
started = time.monotonic()
peer_gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
print("REPORT", lost_workers.report({"actor_rollout": WorkerGroup([rank])}, peer_gone, patience_s=60))
print("NODE", node.node_id, pid, round(time.monotonic() - started, 1))
ray.shutdown()
cluster.shutdown()
"""


@pytest.mark.slow
def test_a_lost_nodes_rank_is_named_once_ray_declares_the_node_dead(monkeypatch):
    """Ray's own test cluster (``ray.cluster_utils.Cluster``): a rank's node removed at once, the driver holding only a
    collective's error that names no one; the report waits for Ray to declare the node dead (its health checks:
    measured 15 s) and names the rank, its pid and the node. About 40 s: marked slow."""
    from _fresh_process import run_fresh

    for key in ("RAY_ADDRESS", "VERL_OAR_RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    process = run_fresh(LOST_NODE_PROBE, timeout=240)
    node, pid, waited = next(line.split()[1:] for line in process.stdout.splitlines() if line.startswith("NODE"))
    report = process.stdout.split("REPORT ", 1)[1]
    print(f"[lost workers] Ray declared the node dead after {waited} s")
    assert "rank 0 of actor_rollout: actor " in report and f"pid {pid}, on node {node} (lost: Ray reports it dead)" \
        in report and "The actor died because its node has died" in report, process.failure()
    assert f"nodes Ray reports dead: node {node}" in report
    assert float(waited) < lost_workers.PATIENCE_S


@pytest.mark.parametrize(("error", "lost"), [
    (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:47775. This is typically "
                  "caused by a remote worker crashing."), True),
    (ValueError("algorithm.oar.tau must be in (0, 1)"), False),
])
def test_only_a_lost_peers_error_waits_for_ray_to_report_it(error, lost):
    assert lost_workers.looks_lost(error) is lost
    wrapped = RuntimeError("the step failed")
    wrapped.__cause__ = error
    assert lost_workers.looks_lost(wrapped) is lost


class _Failing:
    def fit(self):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1")


class _Trainer(lost_workers.LostWorkerMixin, _Failing):
    def __init__(self):
        self.actor_rollout_wg, self.critic_wg = "the actor's group", None


def test_fit_names_the_lost_workers_or_lets_the_error_through(monkeypatch):
    seen = []
    monkeypatch.setattr(lost_workers, "report", lambda groups, exc: seen.append(groups) or "[verl-oar] lost rank 1")
    with pytest.raises(lost_workers.LostWorkerError, match=r"lost rank 1") as caught:
        _Trainer().fit()
    assert isinstance(caught.value.__cause__, RuntimeError)  # verl's error stays in the chain
    assert seen == [{"actor_rollout": "the actor's group"}]  # the trainer's worker groups, by role
    monkeypatch.setattr(lost_workers, "report", lambda groups, exc: None)
    with pytest.raises(RuntimeError, match="Connection closed by peer") as caught:
        _Trainer().fit()
    assert not isinstance(caught.value, lost_workers.LostWorkerError)
