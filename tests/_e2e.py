"""Shared by the end-to-end tests: launch verl's trainer in CPU mode, check a dumped step."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RECIPE_CPU_COPIES = ("qwen2_5_math_1_5b_oar_g", "qwen2_5_math_1_5b_oar_p", "qwen2_5_math_1_5b_cscr",
                     "qwen2_5_math_1_5b_oppo", "qwen2_5_math_1_5b_oppo_teacher", "qwen2_5_math_1_5b_acpo",
                     "qwen2_5_math_1_5b_codapo")
"""the recipes whose CPU copies train: OAR-G's in tests/e2e/test_resume_on_cpu.py (4 steps, then resumed),
OAR-P's in tests/e2e/test_recipes_on_cpu.py, OPPO's (self and teacher) in tests/e2e/test_privileged_e2e_on_cpu.py,
CSCR's in tests/e2e/test_upstream_series_on_cpu.py (on verl with the upstream series), ACPO's and CoDaPO's in
tests/e2e/test_acpo_codapo_e2e_on_cpu.py; that they, with ``REF_MODEL_RUN``, cover every FSDP2 OAR recipe's settings
is checked in tests/unit/test_recipe_configs_on_cpu.py"""

REF_MODEL_RUN = (
    "+algorithm.oar.importance_model=ref", "+algorithm.oar.objective=loglik", "+algorithm.oar.saliency=grad_norm",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
)
"""tests/e2e/test_bf16_e2e_on_cpu.py's OAR-G run, on top of CPU mode's overrides (and bf16): importance
from the reference model, the other objective and saliency, and the reference model offloaded as the 7B
recipes offload it (the one setting of theirs the 1.5B copies do not run)"""

PERTURB_KEYS = ("oar/perturb/copies_mean", "oar/perturb/copies_max", "oar/perturb/cost_passes_mean",
                "oar/perturb/peak_call_tokens")
RECIPE_PERTURB_BUDGET = 16
"""the OAR-P recipes' ``perturb_budget`` (chunk mode)"""

OAR_KEYS = (
    "oar/timing_s/token_importance", "oar/weight/min", "oar/weight/max", "oar/weight/frac_suppressed",
    "oar/weight/frac_amplified", "oar/mass_error/max_abs", "oar/fallback/frac_any",
    "oar/fallback/frac_no_answer", "oar/importance/mean",
)


def launch_recipe(workspace: Path, log: Path, name: str, steps: int, experiment: str, *extra: str,
                  timeout_s: int = 400, env: dict[str, str] | None = None,
                  while_running: Callable[[], None] | None = None) -> tuple[int, str]:
    """A recipe's CPU copy through its own launch script (``python -m verl_oar.cpu.recipe``); ``env``: the
    launch's environment (default: this process's), e.g. a patched verl first on ``PYTHONPATH``; ``while_running``
    is called about every 0.2 s until the launch ends (e.g. to kill one of its workers at a chosen moment)."""
    from verl_oar.cpu.recipe import RECIPES_DIR

    with open(log, "w") as fp:
        proc = subprocess.Popen(
            [sys.executable, "-m", "verl_oar.cpu.recipe", name, "--workdir", str(workspace), "--steps", str(steps),
             "--experiment-name", experiment, "--timeout", str(timeout_s), *extra],
            stdout=fp, stderr=subprocess.STDOUT, env=env,
        )
        deadline = time.monotonic() + timeout_s + 30
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if while_running is not None:
                    while_running()
                time.sleep(0.2)
            if proc.poll() is None:
                raise subprocess.TimeoutExpired(proc.args, timeout_s + 30)
        finally:
            if proc.poll() is None:  # the launch stops its trainer at --timeout; this is the launch itself
                proc.kill()
                proc.wait()
    text = log.read_text()
    if proc.returncode == 0:
        assert f"bash {RECIPES_DIR / f'run_{name}.sh'}" in text  # through the recipe's own script
    return proc.returncode, text


def check_recipe_records(records: list[dict], estimator: str) -> None:
    """What every step of an OAR recipe's CPU copy must log: fp32 rollout/trainer agreement, OAR's keys,
    mass preserved, answers grounded on the span the math reward graded; OAR-G fused into verl's
    log-prob pass, OAR-P in chunk mode within its budget."""
    import pytest

    for record in records:
        data = record["data"]
        assert data["training/rollout_probs_diff_mean"] < 1e-4  # fp32 rollout and trainer agree
        assert data["actor/pg_loss"] == data["actor/pg_loss"]  # not NaN
        assert 0.0 <= data["critic/score/mean"] <= 1.0  # math-verify scores 0 or 1
        assert all(k in data for k in OAR_KEYS), [k for k in OAR_KEYS if k not in data]
        assert data["oar/mass_error/max_abs"] < 1e-4
        # the math reward returns the span it graded, and OAR grounds on exactly that span
        sources = {k: data[f"oar/answer/frac_{k}"] for k in ("none", "locator", "reward", "reward_rejected")}
        assert sources["reward"] > 0 and sources["locator"] == 0 and sources["reward_rejected"] == 0, sources
        assert abs(sum(sources.values()) - 1.0) < 1e-9
        assert data["oar/fallback/frac_no_answer"] == pytest.approx(sources["none"])
        assert data["oar/fallback/no_answer_streak"] in (0.0, 1.0, 2.0)
        if estimator == "oar_g":
            assert data["oar/fused_log_prob"] == 1.0  # the recipe fuses importance into the log-prob pass
        else:
            assert all(k in data for k in PERTURB_KEYS), [k for k in PERTURB_KEYS if k not in data]
            assert "oar/fused_log_prob" not in data  # OAR-P runs in passes of its own
            assert 0 < data["oar/perturb/copies_max"] <= RECIPE_PERTURB_BUDGET
            assert data["oar/perturb/cost_passes_mean"] <= RECIPE_PERTURB_BUDGET + 1


def launch(workspace: Path, log: Path, experiment: str, *extra: str, estimator: str = "oar_g") -> tuple[int, str]:
    with open(log, "w") as fp:
        proc = subprocess.run(
            [sys.executable, "-m", "verl_oar.cpu.launch", "--workdir", str(workspace), "--steps", "2",
             "--adv-estimator", estimator, "--experiment-name", experiment, "--timeout", "330", *extra],
            check=False, stdout=fp, stderr=subprocess.STDOUT, timeout=360,
        )
    return proc.returncode, log.read_text()


CHECKPOINT_SHARDS = ("model", "optim", "extra_state")
"""verl's FSDP checkpoint files of each rank: ``actor/{kind}_world_size_{ranks}_rank_{rank}.pt``"""


def check_complete_checkpoints(folder: Path, ranks: int) -> tuple[int, list[int]]:
    """verl's checkpoint folder: returns (the step ``latest_checkpointed_iteration.txt`` names, the steps with a
    ``global_step_N`` folder) after checking that every step up to the named one is complete: the data loader's
    state and every rank's model, optimizer and extra-state shard load."""
    latest = int((folder / "latest_checkpointed_iteration.txt").read_text().strip())
    steps = sorted(int(p.name.removeprefix("global_step_")) for p in folder.glob("global_step_*"))
    for step in (s for s in steps if s <= latest):
        checkpoint = folder / f"global_step_{step}"
        torch.load(checkpoint / "data.pt", weights_only=False)
        assert (checkpoint / "actor" / "fsdp_config.json").exists(), checkpoint
        for kind in CHECKPOINT_SHARDS:
            for rank in range(ranks):
                torch.load(checkpoint / "actor" / f"{kind}_world_size_{ranks}_rank_{rank}.pt", weights_only=False)
    return latest, steps


def check_reshaped_exactly_where_importance_varies(dump: Path, steps=(1, 2)) -> int:
    """Per row of each dumped step: advantages differ from GRPO's exactly on the reasoning tokens of
    rows whose importance varies, keep their sign and their sum; other rows keep GRPO's credit.
    Returns the number of reshaped rows."""
    reshaped_rows = 0
    for step in steps:
        d = torch.load(dump / f"step_{step}.pt")
        grpo, adv, importance = d["grpo_advantages"], d["advantages"], d["oar_importance"]
        reasoning = d["oar_reasoning_mask"].bool()
        mask = grpo != 0  # rows with a zero group advantage stay zero under both
        varies = torch.tensor([
            bool(reasoning[i].any()) and importance[i][reasoning[i]].unique().numel() > 1 for i in range(len(grpo))
        ])
        reshaped = varies & (d["fallback"] == 0) & mask.any(dim=1)
        for i in range(len(grpo)):
            if reshaped[i]:
                reshaped_rows += 1
                assert not torch.allclose(adv[i][reasoning[i]], grpo[i][reasoning[i]])
                torch.testing.assert_close(adv[i][~reasoning[i]], grpo[i][~reasoning[i]])  # outside: weight 1
                torch.testing.assert_close(adv[i].sum(), grpo[i].sum(), rtol=1e-4, atol=1e-4)
                assert torch.all(torch.sign(adv[i]) == torch.sign(grpo[i]))
            else:
                torch.testing.assert_close(adv[i], grpo[i])  # no variation or a fallback: GRPO credit
    return reshaped_rows


def _rollout_contents(rollout_dir: Path, step: int, keys: list) -> list[tuple[str, str]]:
    """(prompt, response) text of each dumped row, from verl's ``trainer.rollout_data_dir`` file of
    the step, whose ``uid`` column is the row's TransferQueue key ({uid}_{session}_{output})."""
    import json

    path = rollout_dir / f"{step}.jsonl"
    by_key = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        by_key[entry["uid"]] = (entry["input"], entry["output"])
    missing = [k for k in keys if k not in by_key]
    assert not missing, f"{path}: no rollout for dumped rows {missing[:3]}"
    return [by_key[k] for k in keys]


def compare_dumped_steps(run_a: Path, run_b: Path, steps, fields, *, rtol: float = 0.0, atol: float = 0.0) -> dict:
    """Compare two runs' dumped steps (``{run}/dump/step_N.pt``, ``algorithm.oar.dump_dir``) row by row.

    Rows are matched by content -- (prompt, response) from ``{run}/rollouts`` (``trainer.rollout_data_dir``)
    -- since verl draws a fresh uid per prompt in every run; rows with equal content are ordered by
    their values. First asserts that each step's multiset of (prompt, response) is the same in both
    runs (otherwise nothing else is comparable), then that every field agrees within ``atol + rtol *
    |a|`` (default: bit-equal). Returns ``{step: {field: max |a - b|}}``."""
    from collections import Counter

    diffs = {}
    for step in steps:
        dumps, contents, orders = [], [], []
        for run in (run_a, run_b):
            d = torch.load(run / "dump" / f"step_{step}.pt")
            assert all(f in d for f in fields), f"{run}: step {step} dump lacks {set(fields) - set(d)}"
            content = _rollout_contents(run / "rollouts", step, list(d["keys"]))
            values = [tuple(tuple(d[f][i].reshape(-1).tolist()) for f in fields) for i in range(len(content))]
            order = sorted(range(len(content)), key=lambda i: (content[i], values[i]))
            dumps.append(d)
            contents.append([content[i] for i in order])
            orders.append(order)
        only_a, only_b = Counter(contents[0]) - Counter(contents[1]), Counter(contents[1]) - Counter(contents[0])
        assert not only_a and not only_b, (
            f"step {step}: the two runs rolled out different responses ({sum(only_a.values())} of "
            f"{len(contents[0])} differ), so their importance and advantages cannot be compared; "
            f"e.g. {list(only_a)[:1]} vs {list(only_b)[:1]}"
        )
        diffs[step] = {}
        for f in fields:
            a, b = dumps[0][f][orders[0]].double(), dumps[1][f][orders[1]].double()
            assert a.shape == b.shape, f"step {step} {f}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
            diff = (a - b).abs()
            diffs[step][f] = float(diff.max()) if diff.numel() else 0.0
            bad = diff > atol + rtol * a.abs()
            assert not bad.any(), (
                f"step {step} {f}: {int(bad.sum())} of {a.numel()} values differ between the runs beyond "
                f"atol={atol} rtol={rtol} (max |difference| {diffs[step][f]:.3g}, first in row "
                f"{int(bad.nonzero()[0, 0])} of the content-sorted batch)"
            )
    return diffs


CONTENT_ORDERED_SAMPLER = (
    f"trainer.v1.sampler.custom_sampler.path={Path(__file__).resolve()}",
    "trainer.v1.sampler.custom_sampler.name=ContentOrderedReplayBuffer",
)
"""overrides that make a CPU run train each step's rows in an order fixed by their content (below)"""


def __getattr__(name: str):
    # verl loads a custom sampler from a file by name (load_extern_object); built on first use, so
    # that importing this module does not import verl
    if name == "ContentOrderedReplayBuffer":
        return _content_ordered_replay_buffer()
    raise AttributeError(name)


_SAMPLER_CLASSES: dict = {}


def _content_ordered_replay_buffer():
    """verl's sync replay buffer (CPU mode's quick-polling one) handing out each batch's rows sorted
    by (prompt ids, response ids) rather than in the order the rollouts reached TransferQueue.

    verl 0.9.1 orders a training batch as its trajectories were stored (``ReplayBuffer._materialize_batch``
    walks the partition in insertion order, replay_buffer.py:399-405), i.e. as their agent loops
    finished, which varies from run to run; the actor's passes (packed sequences) and the gradient
    sums then round differently, and OAR-G's ``noisy_kl`` importance -- a KL of two nearly equal
    distributions -- magnifies that rounding (~3e-5 relative). Rows with equal content (in one group) are equal
    inputs, so this order is a function of the step's rollouts."""
    if "cls" not in _SAMPLER_CLASSES:
        import transfer_queue as tq

        from verl_oar.cpu.replay_buffer import QuickPollReplayBuffer

        class ContentOrderedReplayBuffer(QuickPollReplayBuffer):
            def sample(self, global_steps: int, partition_id: str, batch_size: int):
                batch, metrics = super().sample(global_steps, partition_id, batch_size)
                data = tq.kv_batch_get(
                    keys=batch.keys, partition_id=partition_id, select_fields=["prompts", "responses"]
                )
                prompts, responses = data["prompts"].unbind(), data["responses"].unbind()
                content = [(tuple(p.tolist()), tuple(r.tolist())) for p, r in zip(prompts, responses)]
                order = sorted(range(len(batch.keys)), key=lambda i: content[i])
                return batch.select_keys([batch.keys[i] for i in order]), metrics

        ContentOrderedReplayBuffer.__module__ = __name__
        _SAMPLER_CLASSES["cls"] = ContentOrderedReplayBuffer
    return _SAMPLER_CLASSES["cls"]
