"""A recipe's CPU copy submitted to a running Ray cluster as a job, the way a cluster user launches a recipe:

    RAY_ADDRESS=http://<head>:8265 python -m verl_oar.cpu.recipe <recipe> --ranks 2 --nodes 2

``recipes/launch.sh`` sees ``$RAY_ADDRESS`` and runs ``ray job submit --no-wait`` (docs/recipes/README.md, section 5);
this module adds what the CPU copy needs of that path and then follows the job, so that the copy's exit code and
output are the job's, as for a run on this machine. Checked against Ray 2.60's job API (``ray.job_submission``)
and verl 0.9.1's ``run_ppo``.

1. The job's runtime env (launch.sh's ``RUNTIME_ENV_JSON``): CPU mode, the metrics file and the import path
   (``launch.job_env_vars``). A job's driver and workers otherwise see the environment of the ``ray start`` that
   started their node, which knows nothing of this run.
2. ``ray_kwargs.ray_init`` joining the cluster (``overrides.join_overrides``): no CPU or GPU counts (Ray refuses
   them when connecting) and no address: the job supervisor sets ``$RAY_ADDRESS`` for the driver to the cluster's.
3. A submission id (launch.sh's ``SUBMISSION_ID``), with which :func:`follow_job` streams the job's log (the
   driver's output, where Ray forwards every worker's, verl's console metrics included) until the job ends, and
   turns its end into an exit code: 0 when it SUCCEEDED, the driver's exit code (or 1) otherwise, 124 after a
   timeout, when the job is stopped first.

Ray's token authentication: a cluster started by ``ray start`` with a token in ``~/.ray/auth_token`` requires it, and
a client (this module, ``ray job submit``, a joining ``ray start``) sends it only with ``RAY_AUTH_MODE=token`` in its
environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid

DASHBOARD_ENV = "RAY_ADDRESS"
"""what ``recipes/launch.sh`` submits to (a dashboard's http address): set, the CPU copy runs as a Ray job"""


def dashboard_address() -> str | None:
    """The dashboard a recipe's copy is submitted to (``$RAY_ADDRESS``, as launch.sh reads it), or None."""
    return os.environ.get(DASHBOARD_ENV) or None


def new_submission_id(experiment_name: str) -> str:
    """A submission id naming the run: ``verl_oar_cpu_<experiment>_<8 hex digits>``."""
    return f"verl_oar_cpu_{experiment_name}_{uuid.uuid4().hex[:8]}"


def submit_env(env: dict[str, str], job_vars: dict[str, str], submission_id: str) -> dict[str, str]:
    """``env`` (launch.sh's environment) plus the job's runtime env (``job_vars`` as its ``env_vars``) and
    submission id, in the variables launch.sh passes to ``ray job submit``."""
    return {**env, "RUNTIME_ENV_JSON": json.dumps({"env_vars": job_vars}), "SUBMISSION_ID": submission_id}


TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def follow_job(address: str, submission_id: str, timeout_s: float | None = None) -> int:
    """Print the job's log as it grows until the job ends; return 0 if it SUCCEEDED, the driver's exit code (1 if
    none) if it FAILED or was STOPPED, 124 if it was still running after ``timeout_s`` (it is stopped then)."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(address)

    async def tail() -> None:
        async for lines in client.tail_job_logs(submission_id):
            print(lines, end="", flush=True)

    try:
        asyncio.run(asyncio.wait_for(tail(), timeout_s))
    except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
        print(f"[verl-oar cpu] job {submission_id} still running after {timeout_s} s; stopping it", flush=True)
        client.stop_job(submission_id)
        wait_until_ended(client, submission_id, patience_s=60)
        return 124
    info = wait_until_ended(client, submission_id, patience_s=60)
    print(f"[verl-oar cpu] job {submission_id}: {info.status}; {info.message}; driver exit code "
          f"{info.driver_exit_code}", flush=True)
    if str(info.status) == "SUCCEEDED":
        return 0
    return info.driver_exit_code or 1


def wait_until_ended(client, submission_id: str, *, patience_s: float):
    """The job's info once its status is terminal (the log stream can end a moment before), or after
    ``patience_s``."""
    deadline = time.monotonic() + patience_s
    while True:
        info = client.get_job_info(submission_id)
        if str(info.status) in TERMINAL or time.monotonic() > deadline:
            return info
        time.sleep(0.5)


if __name__ == "__main__":  # python -m verl_oar.cpu.ray_job <dashboard> <submission id>: follow a submitted job
    sys.exit(follow_job(sys.argv[1], sys.argv[2]))
