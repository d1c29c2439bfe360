"""The end-to-end tier: every test here launches verl's trainer (marked slow). The launches share one
Ray cluster per test session (verl_oar/cpu/ray_cluster.py) instead of starting one each, and each test
checks that its runs left nothing alive in it (actors, placement groups, drivers, held resources)."""

from __future__ import annotations

import pytest
from verl_oar.cpu.ray_cluster import SharedRayCluster


MAX_RANKS = 2
"""the most ranks a launch here runs on (test_two_ranks_on_cpu.py): the session's cluster has room for them (two
pretend GPUs, 11 CPU slots); a one-rank run takes one GPU's bundle and leaves the rest free"""


@pytest.fixture(scope="session")
def shared_ray_cluster(tmp_path_factory):
    """The session's Ray cluster; trainer launches join it through ``$VERL_OAR_RAY_ADDRESS`` (and the
    cluster's ``$RAY_AUTH_MODE``), set here for the session."""
    cluster = SharedRayCluster(tmp_path_factory.mktemp("shared_ray") / "holder.log", ranks=MAX_RANKS)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in cluster.env.items():
            mp.setenv(key, value)
        try:
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(autouse=True)
def runs_leave_the_cluster_empty(shared_ray_cluster):
    """Each test starts on an empty cluster and leaves it empty: a run must never see an earlier run's
    actors (TransferQueue's controller is a named actor in a fixed namespace), placement groups or
    resources."""
    before = shared_ray_cluster.wait_for_no_leftovers()
    assert not before, f"the shared Ray cluster is not empty before the test: {before}"
    yield
    after = shared_ray_cluster.wait_for_no_leftovers()
    assert not after, f"the test's runs left this in the shared Ray cluster: {after}"


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.parent.name == "e2e" and item.get_closest_marker("slow") is None:
            raise pytest.UsageError(f"{item.nodeid}: tests/e2e holds trainer launches only (marked slow)")
