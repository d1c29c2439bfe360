"""A Ray cluster of several nodes on this one machine, started as docs/recipes/README.md (section 5) tells a cluster
user to start one on several machines: ``ray start --head`` on the head, ``ray start --address=<head>`` on every
other node. For tests/e2e/test_two_nodes_on_cpu.py.

Ray 2.60 runs several such nodes on one host (each a raylet with a node id of its own; the nodes share the head's
session folder). What this adds to the two commands, and why:

1. ``--block``, in a session of its own: each ``ray start`` stays in the foreground as the leader of a session that
   holds its node's processes (raylet, agents; the head's GCS and dashboard; the Ray workers too, which the raylet
   puts in process groups of their own but not in new sessions), so the cluster is stopped by those process ids and
   nothing else (never ``ray stop``, which stops every Ray cluster of the machine's user). Stopping a node: SIGTERM to
   its ``ray start`` (Ray drains the node, then ends its processes), SIGKILL to what is left of its session after a
   grace period. Losing a node: SIGKILL to every process of its session at once, as a machine failing.
2. Every port that has a fixed default (GCS 6379, dashboard 8265, the agents' 52365, Ray Client 10001) is picked
   free, so that other Ray clusters of this machine (another test session's, a benchmark's) are not touched.
3. ``RAY_AUTH_MODE=token`` for every node and client: Ray 2.60's ``ray start --head`` turns token authentication on
   by itself when ``~/.ray/auth_token`` exists, but a joining ``ray start --address`` sends the token only with
   ``RAY_AUTH_MODE=token`` set, and otherwise retries, refused, for a minute before giving up; likewise ``ray job
   submit`` and the state API.
4. The nodes get no CPU-mode or run variables (``VERL_PLATFORM``, ``PYTHONPATH``, ``VERL_OAR_*``): a job must bring
   them in its runtime env, as a cluster user's job must.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")
OBJECT_STORE_BYTES = 512 << 20
"""per node: the CPU runs move a tiny model and batches of 16 rows"""
NODE_ENV_DROPPED = ("VERL_PLATFORM", "PYTHONPATH", "RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR")


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free now on this machine (bound at once, then released)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class RayStartCluster:
    """``nodes`` Ray nodes started with ``ray start``, each with ``num_gpus`` pretend GPUs and ``num_cpus`` CPU slots.

    ``dashboard`` is the head's dashboard (``RAY_ADDRESS`` for ``ray job submit``), ``address`` its GCS (what
    ``ray start --address`` joins), ``node_ids[i]`` the Ray node id of the i-th node started (0: the head),
    ``env`` what a client of this cluster needs in its environment."""

    def __init__(self, log_dir: Path, *, nodes: int = 2, num_gpus: int = 1, num_cpus: int = 8,
                 start_timeout_s: float = 180.0):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Ray's unix sockets live under the temp dir: a short path (a socket path has at most 107 characters)
        self.temp_dir = tempfile.mkdtemp(prefix="vo_ray_", dir="/tmp")
        self.procs: list[subprocess.Popen] = []
        self.node_ids: list[str] = []
        self.env = {"RAY_AUTH_MODE": "token"}
        self._base_env = {k: v for k, v in os.environ.items()
                          if k not in NODE_ENV_DROPPED and not k.startswith("VERL_OAR_")}
        self._base_env.update(self.env, RAY_USAGE_STATS_ENABLED="0")
        from ray._private.services import get_node_ip_address

        gcs, dashboard, agent, metrics, client = free_ports(5)
        self.address = f"{get_node_ip_address()}:{gcs}"
        self.dashboard = f"http://127.0.0.1:{dashboard}"
        try:
            self._start_node(
                "--head", f"--port={gcs}", f"--dashboard-port={dashboard}", "--dashboard-host=127.0.0.1",
                f"--dashboard-agent-listen-port={agent}", f"--metrics-export-port={metrics}",
                f"--ray-client-server-port={client}", f"--temp-dir={self.temp_dir}",
                num_gpus=num_gpus, num_cpus=num_cpus, timeout_s=start_timeout_s,
            )  # fmt: skip
            for _ in range(nodes - 1):
                agent, metrics = free_ports(2)
                self._start_node(f"--address={self.address}", f"--dashboard-agent-listen-port={agent}",
                                 f"--metrics-export-port={metrics}", num_gpus=num_gpus, num_cpus=num_cpus,
                                 timeout_s=start_timeout_s)
        except BaseException:
            self.stop()
            raise

    # --- starting ---------------------------------------------------------------------------------------------

    def _start_node(self, *args: str, num_gpus: int, num_cpus: int, timeout_s: float) -> None:
        index = len(self.procs)
        log = open(self.log_dir / f"ray_start_node{index}.log", "w")
        cmd = [RAY, "start", "--block", f"--num-gpus={num_gpus}", f"--num-cpus={num_cpus}",
               f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats", *args]
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self._base_env,
                                           start_new_session=True))
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.procs[-1].poll() is not None:
                raise RuntimeError(f"ray start of node {index} exited with {self.procs[-1].returncode}:\n"
                                   + (self.log_dir / f"ray_start_node{index}.log").read_text()[-3000:])
            alive = self._alive_nodes()
            new = [n for n in alive if n not in self.node_ids]
            if len(alive) == index + 1 and len(new) == 1:
                self.node_ids.append(new[0])
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {index} did not join within {timeout_s} s (alive: {alive}); its log: "
                                   f"{self.log_dir / f'ray_start_node{index}.log'}")
            time.sleep(1.0)

    def _alive_nodes(self) -> list[str]:
        """Node ids the head's state API lists as alive ([] while the dashboard is not up yet)."""
        from ray.util.state import list_nodes

        try:
            with _environ(self.env):
                return [n.node_id for n in list_nodes(address=self.dashboard, raise_on_missing_output=False,
                                                      timeout=10) if n.state == "ALIVE"]
        except Exception:  # noqa: BLE001 - not up yet
            return []

    # --- what ran where -----------------------------------------------------------------------------------------

    def actors(self, job_id: str | None, class_suffix: str, state: str | None = None) -> list:
        """The state API's records of the actors of job ``job_id`` (None: of every job) whose class name ends with
        ``class_suffix``, in ``state`` if given (dead ones included otherwise: the GCS keeps them after the job)."""
        from ray.util.state import list_actors

        filters = [("job_id", "=", job_id)] if job_id else []
        if state:
            filters.append(("state", "=", state))
        with _environ(self.env):
            found = list_actors(address=self.dashboard, filters=filters, detail=True, limit=1000,
                                raise_on_missing_output=False, timeout=30)
        return [a for a in found if a.class_name.endswith(class_suffix)]

    def node_pids(self, index: int) -> list[int]:
        """The processes of node ``index``: its ``ray start`` and everything in its session (its workers included)."""
        sid = self.procs[index].pid
        out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True, check=True).stdout
        return [int(pid) for pid, session in (line.split() for line in out.splitlines()) if int(session) == sid]

    # --- losing and stopping ------------------------------------------------------------------------------------

    def lose_node(self, index: int) -> None:
        """Node ``index`` fails: every process of it gets SIGKILL at once."""
        self._kill_session(index)
        self.procs[index].wait()

    def _kill_session(self, index: int) -> None:
        for pid in self.node_pids(index):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float = 45.0) -> None:
        """Stop the nodes this started, the others first: SIGTERM to each ``ray start`` (Ray drains the node and ends
        its processes), SIGKILL to what is left of its session after ``grace_s``; then remove the temp dir."""
        for index in reversed(range(len(self.procs))):
            proc = self.procs[index]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
            self._kill_session(index)  # whatever of the node outlived its ray start
            proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class _environ:
    """Set environment variables for a block: the state API's client reads ``RAY_AUTH_MODE`` through Ray's config,
    which reads the environment when it is initialised (``Config.initialize``, as ``ray start`` does after setting
    it)."""

    def __init__(self, values: dict[str, str]):
        self.values, self.saved = values, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)
        self._reload()

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._reload()

    @staticmethod
    def _reload() -> None:
        from ray._raylet import Config

        Config.initialize("")
