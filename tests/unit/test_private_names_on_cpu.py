"""Zero private verl names outside ``integration/compat.py``, checked so that a new one cannot slip in: every
underscored name that verl's own source defines (a function, class, attribute or module-level name, read from the
installed verl) is looked for in every module of the package -- as an attribute (``x._name``), a method defined
(an override), a string (``getattr(x, "_name")``) or an import -- and each hit must be listed below, either as the
plugin's own name that happens to equal one of verl's, or as an access not routed through compat yet (each of those
is in ``compat.PRIVATE_NAMES`` or says why it cannot be). compat itself logs what it resolves, overrides or rebinds
(``compat.ACCESS_LOG``, and the file ``$VERL_OAR_PRIVATE_ACCESS_LOG`` names), which the e2e test of the upstream
series asserts stays empty."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "verl_oar"
ROUTER = "integration/compat.py"

OWN = {
    ("core/perturbation/importance.py", "_run"): "its own method",
    ("cpu/hf_rollout.py", "_has_server"): "HFServerAdapter's own flag (verl's vllm/sglang adapters have one too)",
    ("cpu/hf_rollout.py", "_lock"): "HFServer's own lock",
    ("cpu/hf_rollout.py", "_pending"): "HFServer's own queue",
    ("cpu/hf_rollout.py", "_server_task"): "HFServer's own task",
    ("engines/megatron/__init__.py", "_rows"): "its own helper",
    ("engines/rank_dump.py", "_rank"): "the dump's file name (step_{step}_{method}_rank{rank}.pt), not verl's name",
    ("integration/importance_signal.py", "_router_replay"): "its own helper",
    ("integration/memory_check.py", "_attn_implementation"): "transformers' config attribute (not verl's)",
    ("integration/privileged_signal.py", "_rows"): "its own helper",
    ("rewards/tiny_reward.py", "_normalize"): "its own helper",
    ("testbed/fast_runner.py", "_rows"): "its own helper",
    ("testbed/fast_runner.py", "_validate"): "its own helper",
    ("testbed/report.py", "_fmt"): "its own helper",
    ("testbed/report.py", "_rows"): "its own helper",
    ("testbed/start/reward.py", "_normalize"): "its own helper",
    ("testbed/variants/fill32/reward.py", "_normalize"): "its own helper",
    ("testbed/variants/fill64/reward.py", "_normalize"): "its own helper",
    ("testbed/variants/fill8/reward.py", "_normalize"): "its own helper",
    ("testbed/workspace.py", "_normalize"): "its own helper",
}
"""(module, name) -> why this equals a verl private name without touching verl"""

UNROUTED = {
    ("integration/trainer.py", "_init_resource_pool_mgr"): "PPOTrainerSync._init_resource_pool_mgr (compat.PRIVATE_NAMES; "
        "logged by compat.trainer_registry, which every install of the plugin trainer goes through; without PR advantage-hooks)",
    ("integration/trainer.py", "_compute_old_log_prob"): "as above",
    ("integration/trainer.py", "_compute_advantage"): "as above",
    ("integration/grading.py", "_compute_advantage"): "PPOTrainer._compute_advantage (compat.PRIVATE_NAMES), logged "
        "by compat.trainer_registry as the trainer's overrides are",
    ("cpu/verl_patches.py", "_ROLLOUT_REGISTRY"): "cpu/ may not import integration/; applied only without 0004 "
        "(patches_applied() reports it; the e2e test of the series asserts it is not applied)",
    ("engines/megatron/forward.py", "_lm_head_logits_processor"): "engines/ may not import integration/; Megatron only",
    ("cpu/hf_rollout.py", "_server_handle"): "RolloutReplica's instance attribute that its subclasses set in "
        "launch_servers (verl's own replicas do); CPU mode, only without the replica-servers PR (then the public "
        "setters; cpu/ may not import integration/, so not logged: the series' e2e test checks the setters are used)",
    ("cpu/hf_rollout.py", "_server_address"): "as _server_handle",
    ("cpu/vllm_rollout.py", "_get_worker_extension_cls"): "vLLMHttpServer's hook method, listed by verl under 'Hook "
        "methods for subclass overrides'; CPU mode's vLLM server overrides it (cpu/ may not import integration/; its "
        "target is checked by verl_patches.VLLM_TARGETS when the vllm replica loads), only without the vllm-cpu PR "
        "(CPUvLLMSyncHttpServer; patches_applied() reports it; the e2e test of the series asserts it is not applied)",
    ("cpu/vllm_rollout.py", "_iter_all_models_with_config"): "vLLMColocateWorkerExtension's helper naming the models "
        "verl's own post-load step runs on; called, not replaced (checked as _get_worker_extension_cls)",
    ("cpu/vllm_rollout.py", "_update_weights"): "vLLMColocateWorkerExtension's per-bucket load; CPU mode's extension "
        "overrides it to load copies and calls it (checked as _get_worker_extension_cls)",
    ("cpu/verl_patches.py", "_load_vllm"): "a string: the patch record's target, the verl loader whose modules read "
        "vLLM's version (verl_patches.VerlPatch.target checks it exists; nothing calls it)",
}
"""(module, name) -> the private verl name touched outside compat, and why it is not routed through compat (yet)"""


@lru_cache(maxsize=1)
def verl_private_names() -> frozenset[str]:
    """Every ``_name`` (not dunder, not ``_`` alone) that the installed verl's source defines."""
    import verl

    names = set()
    for path in Path(verl.__file__).parent.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__") and len(n) > 1)


def private_names_in(source: str, private: frozenset[str]) -> set[str]:
    """The verl private names ``source`` names: attributes, defined methods/functions, strings, imports from verl."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            found.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in private:
            found.add(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
            found.add(node.value)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "verl":
            found.update(a.name for a in node.names if a.name.startswith("_"))
    return found


def _hits() -> set[tuple[str, str]]:
    private = verl_private_names()
    hits = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel != ROUTER:
            hits |= {(rel, name) for name in private_names_in(path.read_text(), private)}
    return hits


def test_no_module_but_compat_names_a_private_verl_name_unlisted():
    unexpected = sorted(_hits() - OWN.keys() - UNROUTED.keys())
    assert not unexpected, (f"private verl names outside {ROUTER}: {unexpected}. Reach them through compat "
                            "(private_attr / set_private_attr / private_overrides, declared in compat.PRIVATE_NAMES), "
                            "or, for the plugin's own name that equals one of verl's, list it in OWN with why")


def test_the_lists_name_only_what_is_there():
    assert sorted((OWN.keys() | UNROUTED.keys()) - _hits()) == []


def test_the_scan_sees_every_way_of_naming_one():
    private = frozenset({"_gather_and_unpad_packed", "_next_train_batch", "_ROLLOUT_REGISTRY"})
    code = ("from verl.workers.rollout.base import _ROLLOUT_REGISTRY\n"
            "class T:\n    def _next_train_batch(self): pass\n"
            "def f(e): return e._gather_and_unpad_packed, getattr(e, '_next_train_batch')\n")
    assert private_names_in(code, private) == set(private)
    assert private_names_in("def f(e): return e.gather_and_unpad_packed", private) == set()
    assert {"_next_train_batch", "_gather_and_unpad_packed", "_ROLLOUT_REGISTRY"} <= verl_private_names()


def test_compat_logs_each_access_to_the_process_and_the_run_file(tmp_path, monkeypatch):
    from verl_oar.integration import compat

    log = tmp_path / "access.log"
    monkeypatch.setenv(compat.ACCESS_LOG_ENV, str(log))
    monkeypatch.setattr(compat, "ACCESS_LOG", [])

    class Engine:
        def _gather_and_unpad_packed(self, x, pad):
            return x

    gather = compat.private_attr(Engine(), "verl.workers.engine.fsdp.transformer_impl.FSDPEngine._gather_and_unpad_packed")
    assert gather(3, 0) == 3
    with pytest.raises(KeyError, match="compat.PRIVATE_NAMES"):
        compat.record("verl.trainer.ppo.core_algos._undeclared", "read")
    assert compat.ACCESS_LOG == ["verl.workers.engine.fsdp.transformer_impl.FSDPEngine._gather_and_unpad_packed: "
                                 "read on Engine"]
    assert log.read_text().split(" ", 1)[1] == compat.ACCESS_LOG[0] + "\n"


def test_private_overrides_call_the_next_class_and_log_the_override(monkeypatch):
    from verl_oar.integration import compat

    monkeypatch.setattr(compat, "ACCESS_LOG", [])

    class Verl:
        def _next_train_batch(self, n=None):
            return ("verl", n)

    class Ours:
        def batch(self, base, n=None):
            return ("ours", base(self, n))

    Mixed = compat.private_overrides(Ours, "Mixed", {"verl.trainer.ppo.v1.trainer_base.PPOTrainer._next_train_batch": "batch"})
    assert type("T", (Mixed, Verl), {})()._next_train_batch(3) == ("ours", ("verl", 3))
    assert compat.ACCESS_LOG == ["verl.trainer.ppo.v1.trainer_base.PPOTrainer._next_train_batch: overridden by "
                                 f"{__name__}.Mixed.batch"]


def test_every_private_name_says_which_patch_of_the_series_replaces_it():
    from verl_oar.integration import compat

    for name, entry in compat.PRIVATE_NAMES.items():
        assert isinstance(entry, compat.Private) and entry.why, name
    without_series = {n for n, e in compat.PRIVATE_NAMES.items() if e.replaced_by}
    assert {n.rsplit(".", 1)[1] for n in without_series} >= {
        "_init_dataloader", "_next_train_batch", "_save_checkpoint", "_load_checkpoint", "_gather_and_unpad_packed",
        "prepare_model_outputs", "_compute_advantage", "_compute_old_log_prob", "_init_resource_pool_mgr",
        "TRAINER_REGISTRY", "_ROLLOUT_REGISTRY", "_balance_batch"}
    prs = {d.name[3:] for d in (PACKAGE.parent / "upstream" / "verl-0.9.1").glob("[0-9][0-9]-*")}
    for name in without_series:  # "<pr name>" or "<pr name> (<its public API>)": a PR of the series
        assert compat.PRIVATE_NAMES[name].replaced_by.split(" (")[0] in prs, (name, sorted(prs))


def test_on_verl_0_9_1_the_plugin_trainers_private_names_are_logged():
    """The positive control of the series' e2e check (an empty log there): on the installed verl 0.9.1 the plugin
    installs its trainer dispatcher and CoDaSampling's mixin, and the log names what they touch."""
    import json
    import subprocess
    import sys

    code = ("import json, verl\n"
            "from verl.trainer.ppo.v1 import trainer_base\n"  # the plugin installs its trainer hook on this import
            "from verl_oar.integration import compat, codapo_sampling, upstream_hook\n"
            "assert not upstream_hook.available()\n"
            "codapo_sampling.CoDaSamplingMixin\n"
            "print(json.dumps(compat.ACCESS_LOG))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {entry.split(":", 1)[0].rsplit(".", 1)[1] for entry in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert names >= {"TRAINER_REGISTRY", "_compute_advantage", "_compute_old_log_prob", "_init_resource_pool_mgr",
                     "_init_dataloader", "_next_train_batch", "_save_checkpoint", "_load_checkpoint"}, names
