"""The route the plugin takes at the seams of the upstream PRs ``replica-servers`` and ``balance-batch``
(docs/upstream.md) on the imported verl: the public API when the PR is in that verl, else the private name.

:func:`route_report` runs the plugin's own code on verl's own classes: CSCR / OPPO's batch balancing
(``privileged_signal.balance``) on verl's ``PPOTrainerSync`` and the hf replica's choice of how to publish its
server (``hf_rollout.replica_setters_available``). Here it runs on the installed verl 0.9.1 (the private routes;
the balancing one logged by ``compat``); ``tests/unit/test_upstream_prs_on_cpu.py`` (slow) runs it on each PR's
patched copy of verl, where the PR's seam must be detected and used and the others not.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

BALANCE_PRIVATE = "verl.trainer.ppo.v1.trainer_base.PPOTrainer._balance_batch"


def _trainer(dp_size: int):
    """verl's sync trainer with only what its batch balancing reads set (its ``__init__`` starts the workers):
    the actor's data-parallel layout, the mini-batch config, the tokenizer's eos id."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    trainer = object.__new__(PPOTrainerSync)
    trainer.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": list(range(dp_size))})
    trainer.use_critic = False
    trainer.global_steps = 1
    trainer.config = OmegaConf.create({"trainer": {"critic_warmup": 0},
                                       "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}, "rollout": {"n": 2}}})
    trainer.tokenizer = SimpleNamespace(eos_token_id=0)
    return trainer


def route_report(seed: int = 0, dp_size: int = 4) -> dict:
    """What the plugin does on the imported verl (JSON-serialisable): ``seams`` (``upstream_hook.seams()``),
    ``cpu_fixes`` (the CPU-mode patches skipped for verl's own fix, ``verl_patches.upstream_fixes()``),
    ``hf_replica_uses_setters``, ``balance_logged`` (the compat log entries one balancing call added),
    ``balance_as_verl`` (its order is verl's ``_balance_batch`` order) and ``balance_reordered`` (that order is
    not the input's: the check is not vacuous). 16 rows of random lengths in [8, 512] over ``dp_size`` ranks."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.utils.transferqueue_utils import KVBatchMeta

    from verl_oar.cpu import hf_rollout
    from verl_oar.cpu.verl_patches import upstream_fixes
    from verl_oar.integration import compat, privileged_signal, upstream_hook

    rng = random.Random(seed)
    lengths = [rng.randint(8, 512) for _ in range(16)]

    def batch():
        return KVBatchMeta(keys=[f"k{i}" for i in range(len(lengths))], tags=[{"seq_len": n} for n in lengths],
                           partition_id=privileged_signal.PARTITION)

    before = len(compat.ACCESS_LOG)
    got = privileged_signal.balance(_trainer(dp_size), batch())
    logged = compat.ACCESS_LOG[before:]
    want = PPOTrainer._balance_batch(_trainer(dp_size), batch(), {})
    return {"seams": upstream_hook.seams(), "cpu_fixes": sorted(k for k, v in upstream_fixes().items() if v),
            "hf_replica_uses_setters": hf_rollout.replica_setters_available(),
            "balance_logged": logged, "balance_as_verl": list(got.keys) == list(want.keys),
            "balance_reordered": list(got.keys) != list(batch().keys)}


def check_routes(report: dict) -> None:
    """The routes follow the seams: public without a log entry where the PR is in verl, private otherwise."""
    seams = report["seams"]
    assert report["hf_replica_uses_setters"] == seams["replica_servers"], report
    expected_log = [] if seams["balance_batch"] else [f"{BALANCE_PRIVATE}: read on PPOTrainerSync"]
    assert report["balance_logged"] == expected_log, report
    assert report["balance_as_verl"] and report["balance_reordered"], report


def test_on_verl_0_9_1_the_plugin_takes_the_private_routes_and_balances_as_verl():
    report = route_report()
    assert report["seams"] == dict.fromkeys(report["seams"], False), (
        "the suite's verl is the 0.9.1 release, without the upstream PRs", report["seams"])
    assert set(report["seams"]) >= {"replica_servers", "balance_batch"}
    assert report["cpu_fixes"] == [], report["cpu_fixes"]
    check_routes(report)


def test_the_balancing_keeps_every_row_and_tag_for_two_ranks():
    from verl.utils.transferqueue_utils import KVBatchMeta

    from verl_oar.integration import privileged_signal

    lengths = [300, 10, 20, 280, 150, 160, 40, 50]
    out = privileged_signal.balance(_trainer(2), KVBatchMeta(
        keys=[f"k{i}" for i in range(8)], tags=[{"seq_len": n} for n in lengths], partition_id="p"))
    assert sorted(out.keys) == sorted(f"k{i}" for i in range(8))
    assert [t["seq_len"] for t in out.tags] == [lengths[int(k[1:])] for k in out.keys]
    halves = [sum(t["seq_len"] for t in out.tags[:4]), sum(t["seq_len"] for t in out.tags[4:])]
    assert abs(halves[0] - halves[1]) < abs(sum(lengths[:4]) - sum(lengths[4:]))  # 610 vs 400 in the input order
