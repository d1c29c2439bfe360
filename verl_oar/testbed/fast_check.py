"""The fast runner against main_ppo on one dumped step (tests/unit/test_fast_runner_on_cpu.py).

    python -m verl_oar.testbed.fast_check make-fixture tests/fixtures/fast_runner   # main_ppo, minutes
    python -m verl_oar.testbed.fast_check replay tests/fixtures/fast_runner          # the runner's pass, JSON
    python -m verl_oar.testbed.fast_check make-fixture DIR --testbed verl_oar/testbed/variants/fill32 \
        --methods grpo,oar_g                                                          # another testbed

``make-fixture`` trains a testbed (default: the committed start) one step with ``python -m verl.trainer.main_ppo``
for each method (default ``grpo``, ``oar_g`` and ``oar_p``; seed 0, the testbed's settings: 8 prompts x 8
responses, one PPO mini-batch; the ``training_runs`` machinery, one Ray cluster) with the token methods dumping
their step (``algorithm.oar.dump_dir``), and keeps, per method, the metric file (step 0 validation and step 1) and
the step-1 dump (prompts, responses, masks, importance, GRPO and OAR advantages, weights; rows in the order the
actor trained on them). ``fixture.json`` names the testbed, methods, seed and machine (with ``cpu_id``).

``replay`` (a process of its own: it builds verl's actor worker on a one-rank process group) samples the runner's
own step-1 rollouts and compares them with the dump's, then feeds each dump's rows, in the dump's order, to the
runner's ``FastTrainer.train_on`` from the testbed's start weights, with the rewards the runner's reward gives
them, and reports per method: the importance fields against the dump, the advantages against the dump, and
``actor/pg_loss``, ``actor/grad_norm``, ``actor/entropy`` against main_ppo's step-1 metrics. GRPO's run dumps
nothing: its step is replayed on the OAR-G dump's rows (the same step-1 rollouts, in the order OAR-G's run trained
them, which differs from GRPO's run's order: float rounding in the sums).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["FIXTURE_METHODS", "dump_samples", "make_fixture", "replay"]

FIXTURE_METHODS = ("grpo", "oar_g", "oar_p")
SEED = 0


def fixture_settings():
    from verl_oar.testbed.training_runs import RunSettings

    return RunSettings(steps=1, val_every=0)


def make_fixture(out_dir: str | Path, testbed: str | Path | None = None,
                 methods: tuple[str, ...] = FIXTURE_METHODS) -> Path:
    """Run main_ppo one step per method on ``testbed`` (None: the committed start; module docstring) and copy what
    the checks read into ``out_dir``. ``methods`` must include ``oar_g`` when it includes ``grpo`` (GRPO is replayed
    on OAR-G's dump)."""
    from verl_oar.cpu.ray_cluster import shared_cluster
    from verl_oar.testbed.demo import write_val_subset
    from verl_oar.testbed.fast_runner import load_bed, neutral_token_id
    from verl_oar.testbed.machine import cpu_id, machine_info
    from verl_oar.testbed.training_runs import make_runs, run_all
    from verl_oar.testbed.workspace import copy_testbed

    if "grpo" in methods and "oar_g" not in methods:
        raise ValueError("fast_check: GRPO's step is replayed on OAR-G's dump: add oar_g to the methods")

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    settings = fixture_settings()
    with tempfile.TemporaryDirectory(prefix="fast_fixture_") as tmp:
        tmp = Path(tmp)
        source = load_bed(testbed)
        bed = copy_testbed(source, tmp / "testbed")
        val_file = write_val_subset(bed, settings.val_prompts, tmp / "data" / "val_subset.parquet")
        # a caller's cluster (a test session's) is joined as it is; otherwise one is started for these runs
        with shared_cluster(tmp / "ray_cluster.log"):
            runs = make_runs(bed, list(methods), [SEED], settings, neutral_id=neutral_token_id(bed), out_dir=tmp,
                             val_file=val_file)
            run_all(runs, total_steps=settings.steps, log=print)
        for run in runs:
            shutil.copyfile(run.metrics_path, out / f"{run.method}_metrics.jsonl")
            if run.dump_dir is not None:
                shutil.copyfile(run.dump_dir / "step_1.pt", out / f"{run.method}_step_1.pt")
    (out / "fixture.json").write_text(json.dumps({
        "command": "python -m verl_oar.testbed.fast_check make-fixture " + str(out_dir)
        + (f" --testbed {testbed} --methods {','.join(methods)}" if testbed is not None else ""),
        "testbed": None if testbed is None else str(Path(testbed).resolve()),
        "methods": list(methods), "seed": SEED, "settings": vars(settings),
        "testbed_fingerprint": source.manifest["fingerprint"], "machine": {**machine_info(), "cpu_id": cpu_id()},
    }, indent=2) + "\n")
    return out


def dump_samples(dump: dict, rows: list[dict], rollout) -> list:
    """The dump's rows as the runner's scored ``Sample``s, in the dump's order: uid and session from the dump's keys,
    the dataset row matched by prompt ids among ``rows`` (the step's dataloader rows), scored by ``rollout``'s
    reward."""
    from verl_oar.testbed.fast_rollout import Sample

    by_prompt = {tuple(rollout.prompt_ids(r["raw_prompt"])): r for r in rows}
    samples = []
    for b, key in enumerate(dump["keys"]):
        uid, session, _ = str(key).rsplit("_", 2)
        length = int(dump["response_mask"][b].sum())
        prompt = [int(t) for t in dump["prompts"][b]]
        if tuple(prompt) not in by_prompt:
            raise ValueError(f"the dump's row {b} has a prompt that is not among the step's dataloader rows")
        sample = Sample(uid=uid, session=int(session), prompt_ids=prompt,
                        response_ids=dump["responses"][b, :length].tolist(), response_mask=[1] * length,
                        rollout_log_probs=None, row=by_prompt[tuple(prompt)])
        rollout.score(sample)
        samples.append(sample)
    return samples


def replay(fixture: str | Path) -> dict:
    """Each fixture method's step 1 through the runner's actor (module docstring); a JSON-able report."""
    from verl_oar.testbed.fast_actor import prepare_process

    prepare_process()
    import torch

    from verl_oar.testbed.fast_runner import Batches, compose_config, load_bed, overrides_of
    from verl_oar.testbed.fast_step import FastTrainer
    from verl_oar.testbed.training_runs import read_records

    from collections import Counter

    fixture = Path(fixture).resolve()
    info = json.loads((fixture / "fixture.json").read_text())
    bed = load_bed(info.get("testbed"))
    settings = fixture_settings()
    report = {}
    for method in info["methods"]:
        dump = torch.load(fixture / f"{method if method != 'grpo' else 'oar_g'}_step_1.pt", weights_only=False)
        logged = next(r["data"] for r in read_records(fixture / f"{method}_metrics.jsonl") if r["step"] == 1)
        config = compose_config(overrides_of(bed, method, SEED, settings, val_file=bed.val_file))
        trainer = FastTrainer(config)
        rows = Batches(config, trainer.rollout.tokenizer, trainer.rollout.model_config.processor).train()
        trainer.sync_weights(0)  # on_init_end, as the runner's loop
        ours = trainer.rollout.rollout(rows, [f"s1p{i}" for i in range(len(rows))], validate=False)
        lengths = dump["response_mask"].sum(-1).tolist()
        theirs = Counter((tuple(int(x) for x in prompt), tuple(dump["responses"][b, :n].tolist()))
                         for b, (prompt, n) in enumerate(zip(dump["prompts"], lengths)))
        rollouts_identical = Counter((tuple(s.prompt_ids), tuple(s.response_ids)) for s in ours) == theirs
        samples = dump_samples(dump, rows, trainer.rollout)
        metrics = trainer.train_on(1, samples, sync=False)
        signals = trainer.last_signals
        entry = {
            "rows": len(samples), "rollouts_identical": rollouts_identical,
            "score_mean": metrics["critic/score/mean"], "logged_score_mean": logged["critic/score/mean"],
            "advantages_identical": method == "grpo"
            or bool(torch.equal(trainer.last_batch["advantages"], dump["advantages"])),
            "advantages_max_abs_diff": 0.0 if method == "grpo"
            else float((trainer.last_batch["advantages"].double() - dump["advantages"].double()).abs().max()),
            "grpo_advantages_identical": bool(torch.equal(
                (signals.artifacts["grpo_advantages"] if method != "grpo" else trainer.last_batch["advantages"]),
                dump["grpo_advantages"])),
        }
        for name in ("oar_importance", "oar_reasoning_mask", "oar_answer_mask"):
            if method != "grpo":
                entry[f"{name}_identical"] = bool(torch.equal(signals.tensors[name], dump[name]))
                diff = signals.tensors[name].double() - dump[name].double()
                entry[f"{name}_max_abs_diff"] = float(diff.abs().max())
                entry[f"{name}_max_abs"] = float(dump[name].double().abs().max())
        for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            entry[name] = {"runner": float(metrics[name]), "main_ppo": float(logged[name]),
                           "abs_diff": abs(float(metrics[name]) - float(logged[name]))}
        report[method] = entry
        del trainer
    return report


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("make-fixture", "replay"))
    p.add_argument("dir")
    p.add_argument("--testbed", default=None, help="make-fixture: a testbed folder (default: the committed start)")
    p.add_argument("--methods", default=",".join(FIXTURE_METHODS), help="make-fixture: comma-separated")
    args = p.parse_args(argv)
    if args.command == "make-fixture":
        print(make_fixture(args.dir, args.testbed, tuple(m for m in args.methods.split(",") if m)))
    else:
        print("REPLAY " + json.dumps(replay(args.dir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
