"""How a CPU run finds its Ray cluster (verl_oar.cpu.overrides / launch): a cluster of its own by default,
the running one named by ``$VERL_OAR_RAY_ADDRESS`` when set (the test session's, verl_oar/cpu/ray_cluster.py),
with the run's environment handed to that cluster's workers; ``ray_cluster.shared_cluster``, which sets that address
for a block of launches. The runs themselves are tests/e2e."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
from _verl_config import compose_ppo_config
from omegaconf import OmegaConf

from verl_oar.cpu.launch import trainer_env
from verl_oar.cpu.overrides import RAY_ADDRESS_ENV, cpu_overrides

JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def _ray_init(overrides: list[str]) -> dict:
    return OmegaConf.to_container(compose_ppo_config(overrides).ray_kwargs.ray_init)


def test_without_a_cluster_address_a_run_starts_its_own_cluster(monkeypatch, tmp_path):
    monkeypatch.delenv(RAY_ADDRESS_ENV, raising=False)
    ray_init = _ray_init(cpu_overrides(tmp_path))
    assert ray_init["num_gpus"] == 1 and ray_init["num_cpus"] == 8  # one pretend GPU
    assert "address" not in ray_init
    env = trainer_env(tmp_path / "m.jsonl")
    assert env["VERL_PLATFORM"] == "cpu" and env["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "m.jsonl")
    assert JOB_CONFIG not in env  # the workers inherit the trainer's environment from the Ray it starts


def test_with_a_cluster_address_a_run_joins_it_and_hands_its_environment_to_the_workers(monkeypatch, tmp_path):
    monkeypatch.setenv(RAY_ADDRESS_ENV, "127.0.0.1:6380")
    monkeypatch.setenv("VERL_OAR_SOMETHING", "x")
    monkeypatch.setenv("PYTHONPATH", "/patched/verl")
    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")
    ray_init = _ray_init(cpu_overrides(tmp_path))
    # ray.init refuses resource counts when joining a cluster
    assert ray_init["address"] == "127.0.0.1:6380" and ray_init["num_cpus"] is None and ray_init["num_gpus"] is None
    # also after overrides that ask for a cluster of its own (a recipe's CPU copy): run_trainer appends these
    from verl_oar.cpu.overrides import ray_overrides

    own = ["+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=8"]
    assert _ray_init(own + ray_overrides()) == ray_init
    env = trainer_env(tmp_path / "m.jsonl")
    job_env = json.loads(env[JOB_CONFIG])["runtime_env"]["env_vars"]
    assert job_env["VERL_PLATFORM"] == "cpu"
    assert job_env["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "m.jsonl")
    assert job_env["VERL_OAR_SOMETHING"] == "x" and job_env["PYTHONPATH"] == "/patched/verl"
    assert "RAY_DEDUP_LOGS" not in job_env  # the driver's business, not the workers'


def test_the_job_environment_merges_with_verls_runtime_env(monkeypatch, tmp_path):
    """ray.init refuses a job runtime env that sets a variable verl's own runtime env also sets."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    monkeypatch.setenv(RAY_ADDRESS_ENV, "127.0.0.1:6380")
    env = trainer_env(tmp_path / "m.jsonl")
    job_env = json.loads(env[JOB_CONFIG])["runtime_env"]["env_vars"]
    with monkeypatch.context() as m:
        for key, value in env.items():  # verl computes its runtime env in the trainer's environment
            m.setenv(key, value)
        verl_env = get_ppo_ray_runtime_env(compose_ppo_config(cpu_overrides(tmp_path)))["env_vars"]
    assert not set(job_env) & set(verl_env), set(job_env) & set(verl_env)


@pytest.mark.parametrize("address", [None, "127.0.0.1:6380"])
def test_run_trainer_joins_a_cluster_only_when_one_is_named(monkeypatch, tmp_path, address):
    """run_trainer's command: the given one, plus the join overrides when a cluster is named."""
    import verl_oar.cpu.launch as launch

    if address:
        monkeypatch.setenv(RAY_ADDRESS_ENV, address)
    else:
        monkeypatch.delenv(RAY_ADDRESS_ENV, raising=False)
    args_file = tmp_path / "args.json"
    script = f"import json, sys; json.dump(sys.argv[1:], open({str(args_file)!r}, 'w'))"
    rc = launch.run_trainer(["python3", "-c", script, "a=1"], tmp_path / "m.jsonl", cwd=Path(tmp_path), timeout_s=60)
    assert rc == 0
    args = json.loads(args_file.read_text())
    if address:
        assert args == ["a=1", f"++ray_kwargs.ray_init.address={address}", "ray_kwargs.ray_init.num_cpus=null",
                        "++ray_kwargs.ray_init.num_gpus=null"]
    else:
        assert args == ["a=1"]


class _FakeCluster:
    """``SharedRayCluster`` as ``shared_cluster`` uses it (an ``env`` and ``stop``), without a Ray process."""

    started: list = []

    def __init__(self, log):
        self.env = {RAY_ADDRESS_ENV: "127.0.0.1:6399", "RAY_AUTH_MODE": "token"}
        self.stopped = False
        _FakeCluster.started.append(self)

    def stop(self):
        self.stopped = True


@pytest.mark.parametrize("fails", [False, True])
def test_shared_cluster_sets_its_address_for_the_block_then_restores_the_environment_and_stops(
        monkeypatch, tmp_path, fails):
    from verl_oar.cpu import ray_cluster

    monkeypatch.setattr(ray_cluster, "SharedRayCluster", _FakeCluster)
    monkeypatch.delenv(RAY_ADDRESS_ENV, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "before")
    _FakeCluster.started.clear()
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with ray_cluster.shared_cluster(tmp_path / "holder.log") as cluster:
            assert cluster is _FakeCluster.started[0]
            assert os.environ[RAY_ADDRESS_ENV] == "127.0.0.1:6399" and os.environ["RAY_AUTH_MODE"] == "token"
            if fails:
                raise RuntimeError("a run failed")
    assert cluster.stopped
    assert RAY_ADDRESS_ENV not in os.environ and os.environ["RAY_AUTH_MODE"] == "before"


def test_shared_cluster_joins_a_given_address_as_it_is_unless_told_to_start_its_own(monkeypatch, tmp_path):
    from verl_oar.cpu import ray_cluster

    monkeypatch.setattr(ray_cluster, "SharedRayCluster", _FakeCluster)
    monkeypatch.setenv(RAY_ADDRESS_ENV, "127.0.0.1:6380")
    _FakeCluster.started.clear()
    with ray_cluster.shared_cluster(tmp_path / "holder.log") as cluster:
        assert cluster is None and os.environ[RAY_ADDRESS_ENV] == "127.0.0.1:6380"
    assert _FakeCluster.started == [] and os.environ[RAY_ADDRESS_ENV] == "127.0.0.1:6380"
    with ray_cluster.shared_cluster(tmp_path / "holder.log", join_given=False) as cluster:
        assert os.environ[RAY_ADDRESS_ENV] == "127.0.0.1:6399"
    assert cluster.stopped and os.environ[RAY_ADDRESS_ENV] == "127.0.0.1:6380"


def test_ranks_ask_for_one_pretend_gpu_and_three_cpu_slots_each_and_split_the_micro_batch(monkeypatch, tmp_path):
    """``cpu_overrides(ranks=2)``: two FSDP2 ranks (``trainer.n_gpus_per_node``), a cluster with room for verl's two
    ``{CPU: 3, GPU: 1}`` bundles and its other actors, and micro-batches of a rank's share of the step."""
    monkeypatch.delenv(RAY_ADDRESS_ENV, raising=False)
    config = compose_ppo_config(cpu_overrides(tmp_path, n=4, batch_size=4, ranks=2))
    assert config.trainer.n_gpus_per_node == 2 and config.trainer.nnodes == 1
    assert config.ray_kwargs.ray_init.num_gpus == 2 and config.ray_kwargs.ray_init.num_cpus == 11
    assert config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8  # 16 rows / 2 ranks
    assert config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 8
    assert cpu_overrides(tmp_path) == cpu_overrides(tmp_path, ranks=1)  # the default is one rank


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(ranks=0), "positive whole number of ranks"),
    (dict(ranks=3, n=4, batch_size=4), "16 rows per step .* over ranks=3.*3x as many prompts, or ranks=1"),
    (dict(ranks=4, n=3, batch_size=2), "6 rows per step .* over ranks=4.*2x as many prompts, or ranks=2"),
])
def test_a_rank_count_cpu_mode_cannot_run_is_refused_naming_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cpu_overrides(tmp_path, **kwargs)


def test_a_micro_batch_that_does_not_divide_a_ranks_share_is_refused():
    from verl_oar.cpu.overrides import check_ranks

    with pytest.raises(ValueError, match="does not divide a rank's 4 rows .* a divisor of 4"):
        check_ranks(2, rows=8, mini_batch_rows=8, micro_batch_rows=3)
    check_ranks(2, rows=8, mini_batch_rows=8, micro_batch_rows=2)


def test_the_recipe_copies_take_ranks_too():
    from verl_oar.cpu.recipe import recipe_cpu_overrides

    one, two = (recipe_cpu_overrides("/ws", steps=1, experiment_name="x", ranks=r) for r in (1, 2))
    changed = {(a, b) for a, b in zip(one, two, strict=True) if a != b}
    assert changed == {("trainer.n_gpus_per_node=1", "trainer.n_gpus_per_node=2"),
                       ("+ray_kwargs.ray_init.num_gpus=1", "+ray_kwargs.ray_init.num_gpus=2"),
                       ("ray_kwargs.ray_init.num_cpus=8", "ray_kwargs.ray_init.num_cpus=11")}
    with pytest.raises(ValueError, match="16 rows per step .* do not split evenly over ranks=3"):
        recipe_cpu_overrides("/ws", steps=1, experiment_name="x", ranks=3)


def test_the_recipe_copies_split_their_ranks_over_nodes():
    """``--nodes 2``: verl's ``trainer.nnodes``, each node ``ranks / nodes`` pretend GPUs; a split that is not even
    is refused."""
    from verl_oar.cpu.recipe import recipe_cpu_overrides

    one_node, two_nodes = (recipe_cpu_overrides("/ws", steps=1, experiment_name="x", ranks=2, nodes=n) for n in (1, 2))
    changed = {(a, b) for a, b in zip(one_node, two_nodes, strict=True) if a != b}
    assert changed == {("trainer.n_gpus_per_node=2", "trainer.n_gpus_per_node=1"),
                       ("trainer.nnodes=1", "trainer.nnodes=2")}
    for nodes, message in ((3, "ranks=2 do not split evenly over nodes=3"), (0, "nodes=0 is invalid")):
        with pytest.raises(ValueError, match=message):
            recipe_cpu_overrides("/ws", steps=1, experiment_name="x", ranks=2, nodes=nodes)


def test_a_run_submitted_as_a_ray_job_joins_the_jobs_cluster_and_takes_its_environment_along(monkeypatch, tmp_path):
    """run_trainer with ``job`` (a recipe copy under ``$RAY_ADDRESS``): the command gets the join overrides without an
    address (the job's driver finds its cluster in ``$RAY_ADDRESS``), whatever ``$VERL_OAR_RAY_ADDRESS`` says; launch.sh
    gets the run's environment as the job's runtime env and the submission id; the job's end is the run's exit code."""
    import verl_oar.cpu.launch as launch
    from verl_oar.cpu import ray_job

    monkeypatch.setenv(RAY_ADDRESS_ENV, "127.0.0.1:6380")  # another cluster's, e.g. a test session's
    monkeypatch.setenv("PYTHONPATH", "/patched/verl")
    followed = []
    monkeypatch.setattr(ray_job, "follow_job", lambda *job, timeout_s: followed.append((job, timeout_s)) or 7)
    out = tmp_path / "seen.json"
    script = (f"import json, os, sys; json.dump([sys.argv[1:], os.environ['RUNTIME_ENV_JSON'], "
              f"os.environ['SUBMISSION_ID']], open({str(out)!r}, 'w'))")
    rc = launch.run_trainer(["python3", "-c", script, "a=1"], tmp_path / "m.jsonl", cwd=tmp_path, timeout_s=60,
                            job=("http://127.0.0.1:8265", "sub_1"))
    args, runtime_env, submission = json.loads(out.read_text())
    assert args == ["a=1", "ray_kwargs.ray_init.num_cpus=null", "++ray_kwargs.ray_init.num_gpus=null"]
    env_vars = json.loads(runtime_env)["env_vars"]
    assert env_vars["VERL_PLATFORM"] == "cpu" and env_vars["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "m.jsonl")
    assert env_vars["PYTHONPATH"] == "/patched/verl" and RAY_ADDRESS_ENV not in env_vars
    assert submission == "sub_1"
    assert rc == 7 and followed[0][0] == ("http://127.0.0.1:8265", "sub_1") and 0 < followed[0][1] <= 60


class _FakeJobClient:
    """``ray.job_submission.JobSubmissionClient`` as ``ray_job.follow_job`` uses it, without a cluster: the job's log
    (``lines``; ``None``: a log that never ends) and the statuses ``get_job_info`` reports in turn (the last one
    repeated)."""

    lines: list[str] | None = []
    statuses: list[tuple[str, int | None]] = []
    stopped: list[str] = []

    def __init__(self, address: str):
        self.address = address

    async def tail_job_logs(self, submission_id: str):
        import asyncio

        if _FakeJobClient.lines is None:
            await asyncio.sleep(3600)
        for line in _FakeJobClient.lines:
            yield line

    def get_job_info(self, submission_id: str):
        from types import SimpleNamespace

        status, code = _FakeJobClient.statuses.pop(0) if len(_FakeJobClient.statuses) > 1 else \
            _FakeJobClient.statuses[0]
        return SimpleNamespace(status=status, message="", driver_exit_code=code)

    def stop_job(self, submission_id: str):
        _FakeJobClient.stopped.append(submission_id)
        _FakeJobClient.statuses = [("STOPPED", None)]


@pytest.mark.parametrize(("lines", "statuses", "rc"), [
    (["step:1 - actor/pg_loss:0.1\n"], [("RUNNING", None), ("SUCCEEDED", 0)], 0),  # the log ends a moment before
    (["Traceback ...\n"], [("FAILED", 3)], 3),  # the driver's exit code
    ([], [("FAILED", None)], 1),  # failed without a driver exit code (e.g. the entrypoint never started)
    ([], [("STOPPED", None)], 1),
    (None, [("RUNNING", None)], 124),  # still running at the timeout: stopped
])
def test_a_followed_jobs_end_is_the_launchs_exit_code(monkeypatch, capsys, lines, statuses, rc):
    """``ray_job.follow_job``, which the recipe copy's exit code comes from under ``$RAY_ADDRESS``: 0 only for a job
    that SUCCEEDED (waiting for a terminal status after the log ends), the driver's exit code (or 1) for one that
    FAILED or was STOPPED, 124 for one still running at the timeout, which is stopped; the job's log is printed.
    A job failing on two Ray nodes is tests/e2e/test_two_nodes_on_cpu.py's."""
    import ray.job_submission

    from verl_oar.cpu import ray_job

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", _FakeJobClient)
    monkeypatch.setattr(_FakeJobClient, "lines", lines)
    monkeypatch.setattr(_FakeJobClient, "statuses", list(statuses))
    monkeypatch.setattr(_FakeJobClient, "stopped", [])
    assert ray_job.follow_job("http://127.0.0.1:8265", "sub_1", timeout_s=0.5) == rc
    out = capsys.readouterr().out
    assert all(line in out for line in lines or [])
    assert _FakeJobClient.stopped == (["sub_1"] if lines is None else [])
