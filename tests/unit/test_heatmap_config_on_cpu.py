"""``python -m verl_oar.tools.heatmap --config``: the run's estimator settings (recipe yaml composed by Hydra, logged
configs, Hydra override files, layered) replace the tool's defaults in the recompute, each printed with its source;
ACPO recomputed from the model's logits equals a per-token float64 reference (fp32 and bf16 models); CoDaPO is
refused in the recompute with the reason and the fix."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from verl_oar.tools.heatmap import main
from verl_oar.tools.heatmap.run_config import RunConfigError, read_run_config, setting_sources

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "config" / "qwen2_5_math_1_5b_oar_p.yaml"
PROMPT = "max: 3 7 | 2 5"
RESPONSE = "qzt kdm 7 abx fod 5 kle pqa \\boxed{75}"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny randomly initialised Qwen2 (hidden 32, 2 layers) with the CPU workspace's byte tokenizer."""
    from _tiny_models import byte_qwen2

    from verl_oar.cpu.workspace import save_model_dir

    directory = tmp_path_factory.mktemp("heatmap_config_model") / "model"
    save_model_dir(*byte_qwen2(seed=1), directory)
    return directory


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------------
# reading the run's config
# ---------------------------------------------------------------------------------------------------


def test_recipe_then_overrides_layer_key_by_key(tmp_path):
    overrides = _write(tmp_path / "overrides.txt", "# the launch's extra overrides\n+algorithm.oar.tau=0.3\n"
                       "algorithm.oar.perturb_budget=4\nactor_rollout_ref.rollout.temperature=0.7\n"
                       "trainer.total_epochs=3\n")
    run = read_run_config([RECIPE, overrides])
    assert run.adv_estimator == "oar_p" and run.temperature == 0.7 and run.model_path == "Qwen/Qwen2.5-Math-1.5B"
    sources = setting_sources(run, "oar")
    assert sources["tau"] == (0.3, str(overrides)) and sources["perturb_budget"] == (4, str(overrides))
    assert sources["perturb_mode"] == ("chunk", str(RECIPE))          # oar.yaml, through the recipe's defaults
    assert sources["perturb_refine_top"] == (4, "default (OARConfig)")  # not in the recipe: training's default
    assert run.origin["algorithm.adv_estimator"] == str(RECIPE)


def test_composed_and_logged_configs(tmp_path):
    hydra_dir = tmp_path / ".hydra"
    hydra_dir.mkdir()
    _write(hydra_dir / "config.yaml", "algorithm:\n  adv_estimator: cscr\n  cscr:\n    threshold: 0.6\n"
           "actor_rollout_ref:\n  rollout:\n    temperature: 0.9\n  model:\n    path: /models/x\n")
    _write(hydra_dir / "overrides.yaml", "- algorithm.adv_estimator=cscr\n- +algorithm.cscr.alpha=0.5\n")
    run = read_run_config([hydra_dir / "config.yaml", hydra_dir / "overrides.yaml"])
    assert (run.adv_estimator, run.temperature, run.model_path) == ("cscr", 0.9, "/models/x")
    assert setting_sources(run, "cscr")["threshold"] == (0.6, str(hydra_dir / "config.yaml"))
    assert setting_sources(run, "cscr")["alpha"] == (0.5, str(hydra_dir / "overrides.yaml"))
    logged = _write(tmp_path / "wandb.json", json.dumps(
        {"algorithm": {"value": {"adv_estimator": "acpo", "acpo": {"beta": 0.25}}, "desc": None}}))
    run = read_run_config([logged])
    assert run.adv_estimator == "acpo" and setting_sources(run, "acpo")["beta"] == (0.25, str(logged))


@pytest.mark.parametrize("text, needle", [
    ("+algorithm.oar.tua=0.3\n", "Valid keys"),
    ("+algorithm.acpo.beta=2\n", "in [0, 1]"),
    ("algorithm.oar.tau\n", "is not a Hydra override KEY=VALUE"),
    ("actor_rollout_ref.rollout.temperature=hot\n", "is not a number"),
])
def test_bad_run_configs_name_the_file_and_the_fix(tmp_path, text, needle):
    path = _write(tmp_path / "overrides.txt", text)
    with pytest.raises(RunConfigError, match="overrides.txt") as err:
        read_run_config([path])
    assert needle in str(err.value)
    with pytest.raises(RunConfigError, match="no such file"):
        read_run_config([tmp_path / "missing.yaml"])


# ---------------------------------------------------------------------------------------------------
# the recompute takes them
# ---------------------------------------------------------------------------------------------------


def _run(model_dir, out, *args):
    return main(["--model", str(model_dir), "--prompt", PROMPT, "--response", RESPONSE, "--device", "cpu",
                 "--out", str(out), *args])


def test_recompute_uses_the_runs_settings_and_prints_their_sources(model_dir, tmp_path, capsys):
    """Before --config the heatmap scored OAR-P exactly (every token) with the default reshaping whatever the run
    used; now chunk mode, budget, tau, beta and the rollout temperature come from the run, and a flag still wins."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_oar.core.hf import can_share_prefix
    from verl_oar.core.perturbation import PerturbationConfig
    from verl_oar.core.reshape import ReshapeConfig, importance_to_weights
    from verl_oar.tools.heatmap import make_sample
    from verl_oar.tools.heatmap.scoring import oar_p_importance

    overrides = _write(tmp_path / "overrides.txt", "algorithm.adv_estimator=oar_p\n+algorithm.oar.perturb_mode=chunk\n"
                       "+algorithm.oar.perturb_budget=3\n+algorithm.oar.tau=0.3\n+algorithm.oar.beta=0.5\n"
                       "actor_rollout_ref.rollout.temperature=0.7\n")
    report = _run(model_dir, tmp_path / "a", "--estimators", "oar_p", "--config", str(overrides))
    settings = report["config"]["settings"]
    assert settings["algorithm.oar.perturb_mode"] == {"value": "chunk", "source": str(overrides)}
    assert settings["algorithm.oar.tau"] == {"value": 0.3, "source": str(overrides)}
    assert settings["algorithm.oar.floor"]["source"] == "training default (OARConfig)"
    assert settings["actor_rollout_ref.rollout.temperature"] == {"value": 0.7, "source": str(overrides)}
    printed = capsys.readouterr().err
    assert f"algorithm.oar.perturb_budget = 3 ({overrides})" in printed

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sample = make_sample(0, PROMPT, RESPONSE, tokenizer, True)
    pcfg = PerturbationConfig(mode="chunk", budget=3, share_prefix=can_share_prefix(model))
    with torch.no_grad():
        importance = oar_p_importance(model, sample, pcfg, tokenizer.pad_token_id, 8192, tokenizer, 0.7)
    row = report["rows"][0]
    assert torch.equal(torch.tensor(row["scores"]["oar_p"]), importance.float())
    weights = importance_to_weights(importance[None].float(), torch.tensor([sample.reasoning]),
                                    ReshapeConfig(tau=0.3, beta=0.5), answer_found=torch.tensor([True])).weights[0]
    assert torch.equal(torch.tensor(row["weights"]["oar_p"]), weights)
    chunked = sorted(set(round(v, 6) for v, r in zip(row["scores"]["oar_p"], sample.reasoning) if r))
    assert len(chunked) <= 3  # at most K = 3 spans, each one importance

    # no --config: training's defaults (chunk, K=16), what a run with default settings used; not the paper's exact mode
    default = _run(model_dir, tmp_path / "b", "--estimators", "oar_p")
    settings = default["config"]["settings"]
    assert settings["algorithm.oar.perturb_mode"] == {"value": "chunk", "source": "training default (no --config)"}
    assert settings["algorithm.oar.perturb_budget"] == {"value": 16, "source": "training default (no --config)"}
    assert default["rows"][0]["scores"]["oar_p"] != row["scores"]["oar_p"]
    trained = oar_p_importance(model, sample, PerturbationConfig(mode="chunk", budget=16,
                                                                 share_prefix=can_share_prefix(model)),
                               tokenizer.pad_token_id, 8192, tokenizer, 1.0)
    assert torch.equal(torch.tensor(default["rows"][0]["scores"]["oar_p"]), trained.float())
    exact = _run(model_dir, tmp_path / "d", "--estimators", "oar_p", "--oar-p-mode", "exact")
    assert exact["config"]["settings"]["algorithm.oar.perturb_mode"] == {"value": "exact", "source": "--oar-p-mode"}
    flagged = _run(model_dir, tmp_path / "c", "--estimators", "oar_p", "--config", str(overrides), "--oar-p-budget", "2")
    assert flagged["config"]["settings"]["algorithm.oar.perturb_budget"] == {"value": 2, "source": "--oar-p-budget"}
    assert flagged["config"]["oar_p_budget"] == 2 and flagged["config"]["temperature"] == 0.7


def test_without_estimators_the_heatmap_scores_what_the_run_trained(model_dir, tmp_path, capsys):
    """No --estimators: the --config run's algorithm.adv_estimator when the heatmap can recompute it, so the default
    heatmap shows the credit the run used; a GRPO run (no token credit) or no --config: OAR-G and OAR-P; CoDaPO,
    which needs the group, is refused naming the fix."""
    oar_p_run = _write(tmp_path / "oar_p.txt", "algorithm.adv_estimator=oar_p\n")
    report = _run(model_dir, tmp_path / "a", "--config", str(oar_p_run))
    assert report["config"]["estimators"] == ["oar_p"] and list(report["rows"][0]["scores"]) == ["oar_p"]
    assert report["config"]["settings"]["estimators"] == {"value": "oar_p",
                                                          "source": "--config's algorithm.adv_estimator"}
    grpo_run = _write(tmp_path / "grpo.txt", "algorithm.adv_estimator=grpo\n")
    report = _run(model_dir, tmp_path / "b", "--config", str(grpo_run))
    assert report["config"]["estimators"] == ["oar_g", "oar_p"]
    assert "estimators = 'oar_g,oar_p' (tool default (--config's algorithm.adv_estimator is grpo))" \
        in capsys.readouterr().err
    assert _run(model_dir, tmp_path / "c", "--config", str(oar_p_run), "--estimators", "oar_g")["config"][
        "estimators"] == ["oar_g"]
    codapo_run = _write(tmp_path / "codapo.txt", "algorithm.adv_estimator=codapo\n")
    with pytest.raises(SystemExit, match=r"trains codapo.*draw a dump of the run \(--dump\)"):
        _run(model_dir, tmp_path / "d", "--config", str(codapo_run))


def _acpo_reference(model, tokenizer, sample, temperature: float, surrogate: str) -> torch.Tensor:
    """H~ per response token, one position at a time, float64 from the model's own logits."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    p = len(sample.prompt_ids)
    out = []
    for t, token in enumerate(sample.response_ids):
        probs = torch.softmax(logits[p - 1 + t] / temperature, dim=-1)
        if surrogate == "modal":
            out.append(-math.log(float(probs.max())))
        elif surrogate == "sampled":
            out.append(-math.log(float(probs[token])))
        else:
            out.append(-float((probs * probs.log()).sum()))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dtype, surrogate, advantage", [
    ("float32", "modal", 1.0), ("float32", "modal", -0.5), ("float32", "sampled", 1.0), ("float32", "shannon", -1.0),
    ("bfloat16", "modal", 1.0),
])
def test_acpo_recompute_equals_a_per_token_reference(model_dir, tmp_path, dtype, surrogate, advantage):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_oar.core.acpo import ACPOConfig, acpo_weights
    from verl_oar.engines.fsdp.modal import top1_log_probs
    from verl_oar.tools.heatmap import make_sample

    config = _write(tmp_path / "overrides.txt", f"+algorithm.acpo.surrogate={surrogate}\n+algorithm.acpo.beta=0.8\n"
                    "actor_rollout_ref.rollout.temperature=0.8\n")
    report = _run(model_dir, tmp_path / "out", "--estimators", "acpo", "--config", str(config), "--dtype", dtype,
                  "--advantage", str(advantage))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sample = make_sample(0, PROMPT, RESPONSE, tokenizer, True)
    reference = _acpo_reference(model, tokenizer, sample, 0.8, surrogate)
    row = report["rows"][0]
    got = torch.tensor(row["scores"]["acpo"], dtype=torch.float64)
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)  # float64 both; stored as float32
    if surrogate == "modal":  # training's own kernel (engines.fsdp.modal), float32
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1]
        torch.testing.assert_close(got.float(), -top1_log_probs(logits, 0.8), rtol=1e-5, atol=1e-5)
    cfg = ACPOConfig(surrogate=surrogate, beta=0.8)
    weights, _ = acpo_weights(reference[None], torch.tensor([advantage]), torch.ones(1, len(reference), dtype=torch.bool), cfg)
    torch.testing.assert_close(torch.tensor(row["weights"]["acpo"], dtype=torch.float64), weights[0], rtol=1e-5, atol=1e-6)
    assert report["config"]["settings"]["algorithm.acpo.surrogate"] == {"value": surrogate, "source": str(config)}
    assert all(math.isfinite(v) for v in row["weights"]["acpo"]) and min(row["weights"]["acpo"]) >= cfg.w_min


def test_codapo_is_refused_in_the_recompute_with_the_reason(model_dir, tmp_path):
    with pytest.raises(SystemExit) as err:
        _run(model_dir, tmp_path, "--estimators", "oar_g,codapo")
    assert "cannot be recomputed from one response" in str(err.value) and "--dump" in str(err.value)


def test_a_model_or_a_dump_is_needed(tmp_path):
    with pytest.raises(SystemExit, match="give --model PATH"):
        main(["--prompt", PROMPT, "--response", RESPONSE, "--out", str(tmp_path)])


def test_cscr_and_oppo_take_the_runs_sections(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_oar.core.cscr import CSCRConfig
    from verl_oar.core.oppo import OPPOConfig
    from verl_oar.tools.heatmap import make_sample
    from verl_oar.tools.heatmap.privileged import cscr_signal, oppo_signal

    config = _write(tmp_path / "overrides.txt", "+algorithm.cscr.threshold=0.5\n+algorithm.cscr.floor=0.6\n"
                    "+algorithm.oppo.clip=0.0001\n")
    args = ["--estimators", "cscr,oppo", "--ground-truth", "75", "--reward", "1.0"]
    report = _run(model_dir, tmp_path / "a", *args, "--config", str(config))
    default = _run(model_dir, tmp_path / "b", *args)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sample = make_sample(0, PROMPT, RESPONSE, tokenizer, True)
    _, cscr = cscr_signal(model, tokenizer, sample, 1.0, CSCRConfig(threshold=0.5, floor=0.6))
    _, oppo = oppo_signal(model, tokenizer, sample, "75", 1.0, 1.0, OPPOConfig(clip=0.0001))
    row = report["rows"][0]
    assert row["weights"]["cscr"] == cscr.tolist() and row["weights"]["oppo"] == oppo.tolist()
    assert row["weights"]["cscr"] != default["rows"][0]["weights"]["cscr"]
    assert row["weights"]["oppo"] != default["rows"][0]["weights"]["oppo"]
    settings = report["config"]["settings"]
    assert settings["algorithm.cscr.floor"] == {"value": 0.6, "source": str(config)}
    assert settings["algorithm.oppo.clip"] == {"value": 0.0001, "source": str(config)}
    assert settings["algorithm.oppo.prior"]["source"] == "training default (OPPOConfig)"


def test_verls_own_composed_config(tmp_path):
    """What main_ppo's Hydra writes to ``<run dir>/.hydra/config.yaml``: verl's whole composed config (saved here
    from verl's own composition, interpolations unresolved as Hydra saves them)."""
    import sys

    from omegaconf import OmegaConf

    sys.path.insert(0, str(ROOT / "tests"))
    from _verl_config import compose_ppo_config

    config = compose_ppo_config(["algorithm.adv_estimator=oar_p", "+algorithm.oar.perturb_mode=line",
                                 "actor_rollout_ref.rollout.temperature=0.6"])
    OmegaConf.save(config, tmp_path / "config.yaml")
    run = read_run_config([tmp_path / "config.yaml"])
    assert (run.adv_estimator, run.temperature) == ("oar_p", 0.6)
    assert setting_sources(run, "oar")["perturb_mode"] == ("line", str(tmp_path / "config.yaml"))
    assert run.model_path == config.actor_rollout_ref.model.path
