"""Two Ray nodes, launched as a cluster user launches: a cluster of two nodes on this machine, one pretend GPU each,
started with ``ray start --head`` and ``ray start --address=<head>`` (docs/recipes/README.md, section 5;
``tests/_ray_start.py``), then the OAR-G recipe's CPU copy submitted to it on two ranks, one per node:

    RAY_ADDRESS=http://<dashboard> python -m verl_oar.cpu.recipe qwen2_5_math_1_5b_oar_g --ranks 2 --nodes 2

which runs ``bash recipes/run_qwen2_5_math_1_5b_oar_g.sh`` and so ``recipes/launch.sh``'s ``ray job submit``, with
the copy's overrides, its environment as the job's runtime env and ``trainer.nnodes=2 trainer.n_gpus_per_node=1``
(``verl_oar/cpu/ray_job.py``). The nodes' own environment has no CPU mode, no ``PYTHONPATH`` and no ``VERL_OAR_*``:
what the job's workers know of the run reaches them through the job.

1. The job succeeds, and from Ray (not from the configuration): the actor's two ranks ran on the two different nodes
   (each rank's Ray node id, saved by the rank itself in ``$VERL_OAR_RANK_DUMP_DIR``, and the node id and pid of each
   of the job's ``WorkerDict`` actors in Ray's state API agree, and are the cluster's two nodes); each node's worker
   loaded the plugin through verl's ``verl.plugins`` entry point (``plugin.IMPORTED_THROUGH``), from this checkout;
   the step's metrics reach the user's log, the job's log (verl's console logger), and the metrics file.
2. The node that is not the head, holding one rank, is lost (every process of that node killed at once, as a machine
   failing) during step 2 of a run that saves a checkpoint after every step: the job fails, and the launch exits
   non-zero, within ``NODE_LOSS_BOUND_S``; the log names the lost rank and node (``integration/lost_workers.py``: the
   first error verl raises here is the surviving rank's gloo ``Connection closed by peer [127.0.0.1]:<port>``, which
   names neither) when verl's trainer (its TaskRunner actor) outlived the node; when Ray placed the trainer on the
   lost node (Ray's choice; it differed between two runs here), the error is Ray's for the TaskRunner, named by its
   actor id; the checkpoint of step 1 is complete and is the one verl's tracker names. Resuming needs the node
   back; resuming two ranks is tests/e2e/test_worker_loss_on_cpu.py's.

Marked slow: two launches and a cluster start; the module took 586 and 628 s on 2 cores of an AMD EPYC under a load of
~25 (the submitted run 243 and 266 s, the run losing a node 280 s), mostly start-up; the submitted run took 113 s
under a lighter load.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

RECIPE = "qwen2_5_math_1_5b_oar_g"
NODE_LOSS_BOUND_S = 120.0
"""seconds from losing the node to the launch's exit (measured 8-17 s in three runs; when verl's trainer outlives the
node, the plugin waits for Ray to declare the node dead, about 15 s, ``lost_workers.PATIENCE_S`` at most)"""
LAUNCH_TIMEOUT_S = 900
"""a launch's own limit (the hang guard), for 2 heavily loaded cores"""


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """The cluster: two ``ray start`` nodes with one pretend GPU and 8 CPU slots each (a rank's bundle takes 3;
    verl's other actors 5), stopped by their process ids after the module."""
    from _ray_start import RayStartCluster

    cluster = RayStartCluster(tmp_path_factory.mktemp("two_nodes"), nodes=2, num_gpus=1, num_cpus=8)
    try:
        yield cluster
    finally:
        cluster.stop()


def _submit(workspace: Path, run: Path, cluster, steps: int, *extra: str, monkeypatch, while_running=None):
    """The recipe's copy on two ranks over the two nodes, submitted as a job; returns (exit code, launch output,
    submission id)."""
    from _e2e import launch_recipe

    run.mkdir(parents=True)
    monkeypatch.setenv("RAY_ADDRESS", cluster.dashboard)
    for key, value in cluster.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("VERL_OAR_RAY_ADDRESS", raising=False)  # the session's one-node cluster: not this job's
    monkeypatch.setenv("VERL_OAR_RANK_DUMP_DIR", str(run / "ranks"))
    started = time.monotonic()
    rc, text = launch_recipe(
        workspace, run / "launch.log", RECIPE, steps, f"two_nodes_{run.name}", "--ranks", "2", "--nodes", "2",
        f"algorithm.oar.dump_dir={run / 'dump'}", *extra, timeout_s=LAUNCH_TIMEOUT_S, while_running=while_running,
    )  # fmt: skip
    print(f"[two nodes] {run.name}: {time.monotonic() - started:.0f} s wall (2 loaded cores), exit code {rc}")
    submitted = re.search(r"submitted job (\S+) to ", text)
    assert submitted, text[-6000:]
    assert re.search(rf"Job '{re.escape(submitted.group(1))}' submitted successfully", text)  # by ray job submit
    return rc, text, submitted.group(1)


@pytest.mark.slow
def test_a_recipe_submitted_to_two_nodes_runs_a_rank_on_each_with_the_plugin_and_logs_its_metrics(
    two_nodes, cpu_workspace_dir, tmp_path, monkeypatch
):
    from _e2e import check_recipe_records
    from ray.job_submission import JobSubmissionClient

    import verl_oar
    from verl_oar.cpu.launch import read_metrics
    from verl_oar.cpu.overrides import metrics_file
    from verl_oar.integration.plugin import ENTRY_POINT

    run = tmp_path / "ok"
    rc, text, submission = _submit(cpu_workspace_dir, run, two_nodes, 1, monkeypatch=monkeypatch)
    assert rc == 0, text[-6000:]
    assert "trainer.nnodes=2" in text and "trainer.n_gpus_per_node=1" in text
    client = JobSubmissionClient(two_nodes.dashboard)
    info = client.get_job_info(submission)
    assert str(info.status) == "SUCCEEDED", info

    # each rank's own record: its Ray node, the plugin loaded by verl's entry point from this checkout
    dumps = [torch.load(run / "ranks" / f"step_1_gradient_rank{r}.pt") for r in range(2)]
    assert [(d["rank"], d["world_size"], d["dp_size"]) for d in dumps] == [(0, 2, 2), (1, 2, 2)]
    assert {d["node_id"] for d in dumps} == set(two_nodes.node_ids), [d["node_id"] for d in dumps]
    for d in dumps:
        assert d["plugin_imported_through"] == ENTRY_POINT, d["plugin_imported_through"]
        assert d["verl_oar_file"] == verl_oar.__file__, d["verl_oar_file"]
        assert d["param_numel_local"] < d["param_numel_full"]  # an FSDP2 shard on each node
    # Ray's own record of the job's workers: the same two processes, on the same two nodes
    workers = two_nodes.actors(info.job_id, "WorkerDict")
    assert sorted((w.pid, w.node_id) for w in workers) == sorted((d["pid"], d["node_id"]) for d in dumps), workers
    print(f"[two nodes] ranks 0 and 1 ran on nodes {[d['node_id'][:12] for d in dumps]} (head "
          f"{two_nodes.node_ids[0][:12]}), pids {[d['pid'] for d in dumps]}, plugin through {ENTRY_POINT!r} from "
          f"{Path(dumps[0]['verl_oar_file']).parent}")

    # the metrics: in the job's log (what `ray job logs` shows the user) and in the metrics file
    job_log = client.get_job_logs(submission)
    step_lines = [line for line in job_log.splitlines() if "step:1 - " in line]
    assert step_lines, job_log[-6000:]
    for key in ("oar/weight/max", "oar/importance/mean", "actor/pg_loss", "critic/score/mean"):
        assert f"{key}:" in step_lines[0], key
    records = read_metrics(metrics_file(cpu_workspace_dir, "two_nodes_ok"))
    assert [r["step"] for r in records] == [1]
    check_recipe_records(records, "oar_g")


@pytest.mark.slow
def test_losing_the_node_of_a_rank_fails_the_job_in_bounded_time_and_leaves_complete_checkpoints(
    two_nodes, cpu_workspace_dir, tmp_path, monkeypatch
):
    from _e2e import check_complete_checkpoints
    from ray.job_submission import JobSubmissionClient

    run = tmp_path / "node_lost"
    lost = {}

    def ranks_nodes(step: int) -> list[str] | None:
        paths = [run / "ranks" / f"step_{step}_gradient_rank{r}.pt" for r in range(2)]
        try:
            return [torch.load(p)["node_id"] for p in paths] if all(p.exists() for p in paths) else None
        except Exception:  # noqa: BLE001 - still being written
            return None

    def lose_the_worker_nodes_rank_in_step_2() -> None:
        """After step 1's importance pass: find the rank on the node that is not the head (the head holds the job's
        driver; losing it is losing the cluster) and where verl's trainer runs; once both ranks have scored their
        step-2 rows, lose that node."""
        if "rank" not in lost and (nodes := ranks_nodes(1)):
            rank = next(r for r, node in enumerate(nodes) if node != two_nodes.node_ids[0])
            (runner,) = two_nodes.actors(None, "TaskRunnerV1", state="ALIVE")
            lost.update(rank=rank, node=nodes[rank], index=two_nodes.node_ids.index(nodes[rank]), runner=runner)
        if "rank" in lost and "at" not in lost and ranks_nodes(2):
            lost["pids"] = two_nodes.node_pids(lost["index"])
            two_nodes.lose_node(lost["index"])
            lost["at"] = time.monotonic()

    rc, text, submission = _submit(cpu_workspace_dir, run, two_nodes, 2, "trainer.save_freq=1",
                                   f"trainer.default_local_dir={run / 'ckpt'}", monkeypatch=monkeypatch,
                                   while_running=lose_the_worker_nodes_rank_in_step_2)
    ended = time.monotonic()
    assert "at" in lost, f"the ranks never reached step 2:\n{text[-6000:]}"
    print(f"[two nodes] node {lost['index']} ({lost['node'][:12]}: rank {lost['rank']}, {len(lost['pids'])} processes) "
          f"lost in step 2; "
          f"the launch ended {ended - lost['at']:.1f} s later")
    assert rc != 0, text[-6000:]
    assert ended - lost["at"] <= NODE_LOSS_BOUND_S, text[-6000:]
    info = JobSubmissionClient(two_nodes.dashboard).get_job_info(submission)
    assert str(info.status) == "FAILED", info
    runner = lost["runner"]
    if runner.node_id != lost["node"]:
        # the trainer (verl's TaskRunner) outlived the node: the plugin names the rank and the node it lost
        named = re.search(rf"rank {lost['rank']} of actor_rollout: actor \S+, pid \d+, on node {lost['node']} \(lost",
                          text)
        assert "[verl-oar] the run failed after losing Ray workers of its ranks" in text and named, text[-6000:]
        assert f"nodes Ray reports dead: node {lost['node']}" in text, text[-6000:]
    else:
        # Ray placed the trainer itself on the lost node (its choice, run to run): the driver's error is Ray's for the
        # TaskRunner actor, named by its id only (verl's run_ppo adds nothing; the plugin has no process left there)
        assert re.search(rf"Actor(Unavailable|Died)Error: The actor {runner.actor_id} ", text), text[-6000:]
    print(f"[two nodes] verl's trainer ran on node {runner.node_id[:12]}: "
          + ("it outlived the lost node" if runner.node_id != lost["node"] else "lost with the node"))
    assert check_complete_checkpoints(run / "ckpt", 2) == (1, [1])
