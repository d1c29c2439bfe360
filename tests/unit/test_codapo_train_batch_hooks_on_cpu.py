"""CoDaSampling through the upstream series' train batch hooks (``integration.codapo_train_batch_hooks``, PR
train-batch-hooks) schedules exactly as the plugin trainer's mixin (``codapo_sampling.CoDaSamplingMixin``) on verl 0.9.1: the same
step counts, batches (refocused rows, fresh uids, refills), metrics, checkpointed state and resume behaviour, after
an odd and after an even step. The hooks need verl's ``TrainBatchHooks``: the check runs in a subprocess with a copy
of the installed verl patched by ``upstream/apply.sh`` first on ``PYTHONPATH`` (the copy takes ~3 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = r'''
import uuid, numpy as np, torch
from omegaconf import OmegaConf
import verl
assert verl.__file__.startswith(PATCHED), verl.__file__
from verl.utils import tensordict_utils as tu
from verl.trainer.ppo.train_batch_hooks import get_train_batch_hooks
from verl.trainer.ppo import core_algos  # the plugin registers its estimators (and these hooks) on this import
from verl_oar.integration import upstream_hook
from verl_oar.integration.codapo_sampling import CoDaSamplingMixin
from verl_oar.integration.codapo_train_batch_hooks import STATE_ATTR

assert upstream_hook.seams() == dict(advantage_hooks=True, train_batch_hooks=True, logits_reducers=True, replica_servers=True,
                                     balance_batch=True), upstream_hook.seams()
hooks = get_train_batch_hooks("codapo")
assert all(get_train_batch_hooks(n) is hooks for n in ("oar_g", "oar_p", "cscr", "oppo", "acpo"))
assert get_train_batch_hooks("grpo") is not hooks

class Stand:
    """verl's trainer state the schedule reads (a dataloader whose rows number the draws, fresh uids each)."""
    def __init__(self, config):
        self.config, self.global_steps, self.parameter_sync_step, self.drawn = config, 0, 1, 0
    def fetch_train_batch(self, num_prompts=None):
        n = num_prompts or 16
        rows = tu.get_tensordict({"input_ids": torch.arange(self.drawn, self.drawn + n)[:, None],
                                  "uid": np.array([str(uuid.uuid4()) for _ in range(n)], dtype=object)})
        self.drawn += n
        return rows
    _next_train_batch = fetch_train_batch
    def _init_dataloader(self):
        self.steps_per_epoch, self.total_training_steps = 3, 3
    def _save_checkpoint(self): pass
    def _load_checkpoint(self): return None

class Mixin(CoDaSamplingMixin, Stand):
    pass

def config(estimator="codapo", **codapo):
    return OmegaConf.create({"algorithm": {"adv_estimator": estimator, "codapo": {"percentile": 0.75, "repeat_count": 4, **codapo}},
                             "trainer": {"total_training_steps": None, "default_local_dir": "/nonexistent", "resume_mode": "auto"},
                             "actor_rollout_ref": {"actor": {"optim": {"total_training_steps": 3}}}})

def values_for(rows, seed):
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return {u: float(v) for u, v in zip(rows["uid"], perm)}

def run(kind, cfg, steps, resume_state=None, start=1):
    """Drive steps start..steps; the step's values come from its rows' order (seeded), as after_step's read."""
    t = Mixin(cfg) if kind == "mixin" else Stand(cfg)
    if kind == "mixin":
        t._coda_setup(cfg)
    spe = (t._init_dataloader(), t.steps_per_epoch)[1] if kind == "mixin" else hooks.steps_per_epoch(t, 3)
    trace = [("steps_per_epoch", spe)]
    if resume_state is not None:
        t.global_steps = start - 1
        if kind == "mixin":
            t._coda_sampler.load(start - 1, resume_state or None)
        else:
            hooks.load_state_dict(t, resume_state)
    state = None
    for step in range(start, steps + 1):
        t.global_steps = step
        build = (lambda n=None: t._next_train_batch(n)) if kind == "mixin" else (lambda n=None: hooks.build_train_batch(t, n))
        rows = build()
        refill = build(2) if step == 1 else None
        trained = rows if refill is None else tu.concat_tensordict([rows[:14], refill])
        sampler = t._coda_sampler if kind == "mixin" else getattr(t, STATE_ATTR)
        metrics = {}
        if step % 2 == 1:
            metrics.update(sampler.refocus(values_for(trained, step)))
        trace.append((step, [int(x) for x in rows["input_ids"][:, 0]], len(set(rows["uid"])), sorted(metrics.items())))
        if kind == "mixin":
            st = sampler.state(step)
            state = st if st["fresh"] or st["rows"] is not None else {}
        else:
            state = hooks.state_dict(t)
    return trace, state

for cfg in (config(), config("oar_g", compose=True)):
    a, sa = run("mixin", cfg, 3)
    b, sb = run("hooks", cfg, 3)
    assert a == b, (a, b)
    assert a[0] == ("steps_per_epoch", 6)
    # resume after step 1 (a first use) from its state, and after step 2 (a second use: nothing pending)
    _, s1 = run("hooks", cfg, 1)
    assert set(s1) == {"global_steps", "rows", "fresh"} and s1["rows"] is not None
    _, s2 = run("hooks", cfg, 2)
    assert s2 == {}                                                  # verl then writes no trainer_state.pt
    ra, _ = run("mixin", cfg, 3, resume_state=s1, start=2)
    rb, _ = run("hooks", cfg, 3, resume_state=s1, start=2)
    assert ra == rb and ra[1][1] == a[2][1], (ra, a)                 # the resumed step 2 is the uninterrupted one
    rb2, _ = run("hooks", cfg, 3, resume_state={}, start=3)
    assert rb2[1][0] == 3 and len(rb2[1][1]) == 16                  # after an even step: a fresh first use
    try:
        run("hooks", cfg, 2, resume_state={}, start=2)
        raise AssertionError("resumed after an odd step without state")
    except RuntimeError as exc:
        assert "trainer_state.pt" in str(exc) and "sampling=false" in str(exc), exc

# inert unless sampling is on: verl's defaults
for cfg in (config("oar_g"), config(sampling=False)):
    t = Stand(cfg)
    t.global_steps = 2
    assert hooks.steps_per_epoch(t, 3) == 3 and hooks.state_dict(t) == {}
    assert [int(x) for x in hooks.build_train_batch(t, None)["input_ids"][:, 0]] == list(range(16))
    hooks.after_step(t, None, {})
    hooks.load_state_dict(t, {})
print("OK")
'''


@pytest.fixture(scope="module")
def patched_verl(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("verl_series")
    proc = subprocess.run(["bash", str(ROOT / "upstream" / "apply.sh"), str(dest)],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dest


def test_the_hooks_schedule_exactly_as_the_mixin_and_resume_after_odd_and_even_steps(patched_verl):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(patched_verl), os.environ.get("PYTHONPATH", "")])}
    env.pop("VERL_PLATFORM", None)
    proc = subprocess.run([sys.executable, "-c", CHECK.replace("PATCHED", repr(str(patched_verl)))], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


METRICS_CHECK = r'''
import verl
assert verl.__file__.startswith(PATCHED), verl.__file__
from types import SimpleNamespace
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos  # the plugin registers its estimators and hooks on this import
from verl.trainer.ppo.advantage_hooks import get_advantage_hooks

trainer = SimpleNamespace(global_steps=3, config=OmegaConf.create({"algorithm": {"adv_estimator": "acpo"}}))
batch = SimpleNamespace(keys=["u1_0_0", "u2_0_0"], tags=[{}, {}])
metrics = {}
with get_advantage_hooks("acpo").advantage_context(trainer, batch, metrics) as signals:
    signals.metrics.update({"acpo/frac_clipped": 0.25, "weight/max": 2.0, "codapo/value/mean": 1.0})
assert metrics == {"acpo/frac_clipped": 0.25, "oar/weight/max": 2.0, "codapo/value/mean": 1.0}, metrics
print("OK")
'''


def test_estimator_metrics_keep_their_methods_prefix_through_the_advantage_hooks(patched_verl):
    """As the plugin trainer logs them (``trainer.OWN_PREFIXES``): ``acpo/*``, ``codapo/*`` ... under their own name,
    the rest under ``oar/`` (the hooks logged ``oar/acpo/...`` before)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(patched_verl), os.environ.get("PYTHONPATH", "")])}
    env.pop("VERL_PLATFORM", None)
    proc = subprocess.run([sys.executable, "-c", METRICS_CHECK.replace("PATCHED", repr(str(patched_verl)))], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


STARTUP_CHECK = r'''
import sys
sys.path.insert(0, TESTS)
import verl
assert verl.__file__.startswith(PATCHED), verl.__file__
from _verl_config import compose_ppo_config
from verl.trainer.ppo import core_algos  # the plugin registers its estimators and hooks on this import
from verl.trainer.ppo.advantage_hooks import get_advantage_hooks
from verl_oar.cpu.overrides import cpu_overrides

config = compose_ppo_config(cpu_overrides("/ws", adv_estimator="oar_g") + ["+algorithm.codapo.compose=true"])
hooks = get_advantage_hooks("oar_g")
hooks.validate(config, "sync")               # compose and CoDaSampling are not refused with the series
hooks.configure_workers({}, config)
assert "oar_memory" in config.actor_rollout_ref, list(config.actor_rollout_ref)
print("OK")
'''


def test_the_hooks_start_a_run_as_the_plugin_trainer_does_memory_check_included(patched_verl):
    """``validate`` prints the memory estimate and ``configure_workers`` hands the workers their memory check, as
    ``trainer.OARTrainerSync`` does (the hooks skipped both before); compose with CoDaSampling passes start-up."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(patched_verl), os.environ.get("PYTHONPATH", "")])}
    env.pop("VERL_PLATFORM", None)
    code = STARTUP_CHECK.replace("PATCHED", repr(str(patched_verl))).replace("TESTS", repr(str(ROOT / "tests")))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "[verl-oar] memory estimate per GPU" in proc.stdout, proc.stdout[-3000:]
