"""The study's phase runner (benchmarks/study.py) and the fast runner's study methods: seeds parsing, what counts as
a finished run (a crash is final), what ``collect`` keeps, and the ablation / tau methods' overrides."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from _benchmarks import load_benchmark

from verl_oar.testbed.fast_runner import METHODS, load_bed, overrides_of
from verl_oar.testbed.training_runs import RunSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def study():
    return load_benchmark("study")


def test_seeds(study):
    assert study.parse_seeds("1000-1004") == [1000, 1001, 1002, 1003, 1004]
    assert study.parse_seeds("5,1,3-4,1") == [1, 3, 4, 5]


def _write_run(path: Path, steps: int, *, last: int | None = None, error: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "data": {"val-core/verl_oar/pick_max/acc/mean@1": 0.4}}]
    lines += [{"step": s, "data": {"critic/score/mean": 0.5 + s / 100}} for s in range(1, (last or steps) + 1)]
    lines[-1]["data"]["val-core/verl_oar/pick_max/acc/mean@1"] = 0.9
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    if error:
        Path(str(path) + ".error").write_text("Traceback ...\nNoAnswerError: boom\n")
    if last is None or error:
        Path(str(path) + ".meta.json").write_text(json.dumps({"steps": steps, "seconds": 1.5}))


def test_finished_store_and_collect(study, tmp_path, capsys):
    runs, store = tmp_path / "runs", tmp_path / "store"
    done = study.run_path(runs, "tuning", "fill2", "grpo", 1e-3, 1000)
    partial = study.run_path(runs, "tuning", "fill2", "grpo", 1e-3, 1001)
    crashed = study.run_path(runs, "tuning", "fill2", "oar_g", 4e-3, 1000)
    _write_run(done, 6)
    _write_run(partial, 6, last=3)
    _write_run(crashed, 6, last=2, error=True)
    assert study.finished(done, 6) and not study.finished(partial, 6) and study.finished(crashed, 6)
    args = ["--runs-dir", str(runs), "--store", str(store)]
    assert study.main(["store", *args]) == 0
    assert study.main(["store", *args]) == 0  # a second pass adds nothing
    assert len(study.read_store(store)) == 2  # the unfinished run is left out
    out = tmp_path / "results.json"
    capsys.readouterr()
    assert study.main(["collect", "--out", str(out), "--store", str(store)]) == 0  # no cell holds its 5 seeds yet
    assert json.loads(out.read_text())["runs"] == []
    assert "left out (incomplete) tuning fill2 grpo lr=0.001: 1 of 5 seeds" in capsys.readouterr().out
    for method, lr, steps in (("grpo", 1e-3, 6), ("oar_g", 4e-3, 2)):
        for seed in range(1001 if method == "oar_g" else 1002, 1005):
            _write_run(study.run_path(runs, "tuning", "fill2", method, lr, seed), steps)
    _write_run(partial, 6)
    assert study.main(["store", *args]) == 0
    out.unlink()
    assert study.main(["collect", "--out", str(out), "--store", str(store), "--note", "cmd"]) == 0
    result = json.loads(out.read_text())
    by_seed = {(r["method"], r["seed"]): r for r in result["runs"]}
    assert set(by_seed) == {(m, s) for m in ("grpo", "oar_g") for s in range(1000, 1005)}
    assert by_seed[("grpo", 1000)]["reward"] == [0.51, 0.52, 0.53, 0.54, 0.55, 0.56]
    assert by_seed[("grpo", 1000)]["val_accuracy"] == {"0": 0.4, "6": 0.9}
    assert by_seed[("oar_g", 1000)]["steps"] == 6 and "NoAnswerError" in by_seed[("oar_g", 1000)]["error"]
    assert result["commands"] == ["cmd"] and result["machine"]["runs_per_cpu"] == {"unknown": 10}
    capsys.readouterr()
    assert study.main(["status", "--store", str(store)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "tuning  fill2   grpo             lr=0.001     5 runs", "tuning  fill2   oar_g            lr=0.004     4 runs + 1 crashed"]
    # another task's collect leaves these out; a run stored twice is refused with the fix named
    assert study.main(["collect", "--out", str(tmp_path / "r8.json"), "--store", str(store), "--tasks", "fill8"]) == 0
    assert json.loads((tmp_path / "r8.json").read_text())["runs"] == []
    line = study.store_file(store, "tuning", "fill2").read_text().splitlines()[0]
    with open(study.store_file(store, "tuning", "fill2"), "a") as f:
        f.write(line + "\n")
    with pytest.raises(SystemExit, match="a second time; keep the first line"):
        study.read_store(store)


def test_the_committed_store_holds_the_committed_results(study):
    """The results JSON is collected from the store: every committed run is in it, with the CPU it ran on."""
    results = json.loads((ROOT / "benchmarks" / "results_study_cpu.json").read_text())
    stored = {tuple(e[k] for k in study.KEY): e for e in study.read_store(study.STORE)}
    for run in results["runs"]:
        entry = stored[tuple(run[k] for k in study.KEY)]
        assert {k: v for k, v in entry.items() if k != "cpu"} == {k: v for k, v in run.items() if k != "cpu"}
        assert entry["cpu"]


@pytest.mark.parametrize("task", ["fill2", "fill8"])
def test_plan_reproduces_the_evaluations_that_ran(study, task):
    """``plan`` on a committed task's tuning runs names the rates and length its stored evaluation runs used."""
    chosen, steps, commands = study.plan_commands(study.read_store(study.STORE, "tuning", task), task)
    evals = study.read_store(study.STORE, "eval", task)
    assert {e["steps"] for e in evals} == {steps}
    for method, lr in chosen.items():  # 20 evaluation seeds at each method's chosen rate
        assert sorted(e["seed"] for e in evals if e["method"] == method and e["lr"] == lr) == list(range(2000, 2020))
    grpo_rates = {e["lr"] for e in evals if e["method"] == "grpo"}
    assert len(commands) == 2 and grpo_rates == {0.0005, 0.001, 0.002, 0.004}


def test_plan_at_the_longest_task_and_refusals(study):
    def run(method, lr, seed, reach):
        return {"phase": "tuning", "task": "fill32", "method": method, "lr": lr, "seed": seed, "steps": 32,
                "reward": [0.5] * (reach - 3) + [0.9] * (35 - reach), "val_accuracy": {"0": 0.4, "32": 0.9}}

    rates = (0.0005, 0.001, 0.002, 0.004)
    runs = [run(m, lr, s, 20 - 4 * (lr == 0.002) - (m == "oar_g" and lr == 0.004) * 8)
            for m in ("grpo", "oar_g") for lr in rates for s in range(1000, 1005)]
    chosen, steps, commands = study.plan_commands(runs, "fill32")
    assert chosen == {"grpo": 0.002, "oar_g": 0.004} and steps == 32  # GRPO's median 16 steps, doubled
    assert commands[1].endswith("--methods grpo --lrs 0.0005,0.001,0.004 --seeds 2000-2019 --steps 32")
    assert "oar_g_no_amplify@0.004" in commands[2] and "oar_g_tau0.75@0.004" in commands[2]
    assert "cscr@0.002" in commands[3] and "oar_g_codapo@0.002" in commands[3] and "2000-2004" in commands[3]
    with pytest.raises(SystemExit, match="oar_g at lr 0.001 has seeds"):
        study.plan_commands([r for r in runs if not (r["method"] == "oar_g" and r["lr"] == 0.001
                                                     and r["seed"] == 1003)], "fill32")


@pytest.mark.parametrize("method,key,value", [
    ("oar_g_no_amplify", "amplify", "false"), ("oar_g_no_suppress", "suppress", "false"),
    ("oar_g_no_preserve_mass", "preserve_mass", "false"), ("oar_g_tau0.25", "tau", "0.25"),
    ("oar_g_tau0.75", "tau", "0.75"),
])
def test_ablation_methods_change_one_oar_setting_of_oar_g(method, key, value, tmp_path):
    assert METHODS[method][0] == "oar_g"
    bed = load_bed(None)
    settings = RunSettings(lr=2e-3)
    got = overrides_of(bed, method, 1000, settings, val_file=tmp_path / "v.parquet")
    base = overrides_of(bed, "oar_g", 1000, settings, val_file=tmp_path / "v.parquet")
    assert f"+algorithm.oar.{key}={value}" in got
    def rest(overrides):  # everything else, the run's name aside
        return [o for o in overrides if not o.startswith((f"+algorithm.oar.{key}=", "trainer.experiment_name="))]

    assert rest(got) == rest(base) and f"trainer.experiment_name={method}_seed1000" in got
    assert "algorithm.adv_estimator=oar_g" in got and "actor_rollout_ref.actor.optim.lr=0.002" in got


def test_a_method_at_one_rate_and_refusals(study, tmp_path, capsys):
    runs, store = tmp_path / "runs", tmp_path / "store"
    for seed in (7, 8):  # already finished: the runner skips them (nothing is trained here)
        for method, lr in (("grpo", 1e-3), ("oar_g", 2e-3)):
            _write_run(study.run_path(runs, "eval", "fill2", method, lr, seed), 4)
    for method, lr in (("grpo", 1e-3), ("oar_g", 2e-3)):  # seed 9: in the store only (another machine's scratch)
        study.append_to_store(store, {"phase": "eval", "task": "fill2", "method": method, "lr": lr, "seed": 9,
                                      "steps": 4, "seconds": 1.0, "reward": [0.5] * 4, "val_accuracy": {}, "cpu": "x"})
    assert study.main(["run", "--phase", "eval", "--task", "fill2", "--methods", "grpo@1e-3,oar_g@2e-3",
                       "--seeds", "7-9", "--steps", "4", "--runs-dir", str(runs), "--store", str(store)]) == 0
    assert len(study.read_store(store)) == 2 and not (runs / "eval" / "fill2" / "grpo" / "lr0.001_seed9.jsonl").exists()
    with pytest.raises(SystemExit, match="has no rate"):
        study.main(["run", "--phase", "eval", "--task", "fill2", "--methods", "grpo", "--seeds", "7", "--steps", "4",
                    "--runs-dir", str(runs)])
    with pytest.raises(SystemExit, match="unknown method 'nonesuch'; the fast runner carries grpo, .* main_ppo the "
                                         "testbed's cscr, oppo"):
        study.main(["run", "--phase", "eval", "--task", "fill2", "--methods", "nonesuch@1e-3", "--seeds", "7",
                    "--steps", "4", "--runs-dir", str(runs)])


def test_methods_the_fast_runner_lacks_train_through_main_ppo(study):
    """docs/study.md: the other registered methods run through main_ppo (the demo's route, tested by the demo's and
    the e2e launches); every testbed method has exactly one route."""
    from verl_oar.testbed.methods import METHODS as TESTBED_METHODS

    assert {m: study.runner_of(m) for m in ("grpo", "oar_g", "oar_p", "oar_p_chunk16", "oar_g_tau0.25")} == dict.fromkeys(
        ("grpo", "oar_g", "oar_p", "oar_p_chunk16", "oar_g_tau0.25"), "fast")
    others = {m for m in TESTBED_METHODS if study.runner_of(m) == "main_ppo"}
    assert others == {"cscr", "oppo", "oppo_teacher", "acpo", "codapo", "oar_g_codapo"}
    # their same-runner control: GRPO through main_ppo, stored under its own name beside the fast runner's GRPO
    assert study.SAME_RUNNER_CONTROL == {"grpo_main_ppo": "grpo", "oar_g_main_ppo": "oar_g"}
    assert {study.runner_of(m) for m in study.SAME_RUNNER_CONTROL} == {"main_ppo"}
    assert study.planned_seeds("eval", "grpo_main_ppo") == study.parse_seeds(study.OTHER_SEEDS)


def test_a_main_ppo_method_missing_its_teacher_stops_before_any_run(study, tmp_path):
    """OPPO's teacher is built per start (fill8 has none): the run stops at start-up naming the build command,
    instead of training the grid's earlier cells and dying mid-grid."""
    runs = tmp_path / "runs"
    with pytest.raises(SystemExit, match=r"no OPPO teacher .*python -m verl_oar.testbed.teacher .*fill8"):
        study.main(["run", "--phase", "eval", "--task", "fill8", "--methods", "grpo@1e-3,oppo_teacher@1e-3",
                    "--seeds", "7", "--steps", "4", "--runs-dir", str(runs), "--store", str(tmp_path / "store")])
    assert not runs.exists()


def test_two_processes_share_a_grid_through_claims(study, tmp_path):
    import subprocess

    path = tmp_path / "eval" / "fill2" / "grpo" / "lr0.001_seed7.jsonl"
    path.parent.mkdir(parents=True)
    assert study.claim(path) and study.claim(path)  # this process's own claim holds
    lock = Path(str(path) + ".claim")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lock.write_text(str(live.pid))
        assert not study.claim(path)  # another live process trains it
    finally:
        live.kill()
        live.wait()
    assert study.claim(path) and lock.read_text() == str(os.getpid())  # its process is gone: taken over


def _child(tmp_path, name: str, code: str):
    from verl_oar.testbed.training_runs import Run

    return Run(method=name, seed=0, cmd=[sys.executable, "-c", code], metrics_path=tmp_path / f"{name}.jsonl",
               log_path=tmp_path / f"{name}.log", cwd=tmp_path)


def test_run_all_tells_a_kill_from_outside_from_a_failure(tmp_path):
    """A trainer killed by a signal from outside (an operator, the OOM killer) raises RunInterrupted; one that exits
    non-zero, or that run_all stops at its timeout, is a failure (RuntimeError)."""
    from verl_oar.testbed.training_runs import RunInterrupted, run_all

    kill = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    with pytest.raises(RunInterrupted, match=r"killed/seed0 \(signal 9\)"):
        run_all([_child(tmp_path, "killed", kill)], total_steps=1, log=lambda m: None)
    with pytest.raises(RuntimeError) as failed:
        run_all([_child(tmp_path, "killed", kill), _child(tmp_path, "exits", "raise SystemExit(3)")],
                total_steps=1, log=lambda m: None)
    assert not isinstance(failed.value, RunInterrupted)  # one run failed on its own: a failure
    with pytest.raises(RuntimeError) as slow:
        run_all([_child(tmp_path, "slow", "import time; time.sleep(60)")], total_steps=1, log=lambda m: None,
                timeout_s=1)
    assert not isinstance(slow.value, RunInterrupted)


def test_a_run_killed_from_outside_is_not_stored(study, tmp_path):
    """A crash is stored (censored, never re-run); a kill from outside is not the run's failure: nothing is stored,
    the claim is released and the process stops, so that the same command trains the run again."""
    from verl_oar.testbed.training_runs import RunInterrupted

    class Route:
        def __init__(self, error):
            self.error = error

        def train(self, method, seed, settings, path, log):
            path.write_text('{"step": 0, "data": {}}\n')
            raise self.error

    args = type("Args", (), {"runs_dir": str(tmp_path / "runs"), "store": str(tmp_path / "store"), "phase": "eval",
                             "task": "fill32", "steps": 4})()
    with pytest.raises(RunInterrupted):
        study.train_one(args, Route(RunInterrupted("cscr/seed7 (signal 9)")), "main_ppo", "cscr", 1e-3, 7, set(),
                        {"cpu": "CPU"}, None)
    path = study.run_path(Path(args.runs_dir), "eval", "fill32", "cscr", 1e-3, 7)
    assert not (tmp_path / "store").exists() and not path.exists() and not Path(str(path) + ".claim").exists()
    assert study.train_one(args, Route(RuntimeError("boom")), "main_ppo", "cscr", 1e-3, 7, set(), {"cpu": "CPU"}, None)
    [stored] = study.read_store(tmp_path / "store", "eval", "fill32")
    assert "boom" in stored["error"] and stored["runner"] == "main_ppo"


def test_a_replication_or_runners_phase_refuses_seeds_another_phase_used(study, tmp_path):
    stored = [{"phase": "eval", "task": "fill32", "method": "grpo", "lr": 0.001, "seed": 2003},
              {"phase": "replication", "task": "fill32", "method": "grpo", "lr": 0.001, "seed": 4000},
              {"phase": "eval", "task": "fill8", "method": "grpo", "lr": 0.001, "seed": 4001}]
    study.refuse_seen_seeds([4000, 4001], stored, "fill32")  # its own phase, another task: fine
    with pytest.raises(SystemExit, match=r"seeds \[2003\].*4000-4039"):
        study.refuse_seen_seeds([2003, 4002], stored, "fill32")
    with pytest.raises(SystemExit, match=r"seeds \[4000\].*7000-7009"):
        study.refuse_seen_seeds([4000], stored, "fill32", "runners")
    assert study.planned_seeds("runners", "grpo_main_ppo") == list(range(7000, 7010))
    assert study.planned_seeds("replication", "oar_g") == list(range(4000, 4040))
