"""``verl-oar check`` (verl_oar/tools/check.py): every committed recipe passes with a local model; a run the
plugin refuses exits 1 with the refusal's message and no stack trace; ground truths and responses are counted
with the package's math reward and answer locator; ``--json`` prints the same report as JSON."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_oar.cpu.recipe import RECIPES_DIR, recipe_names
from verl_oar.tools import check

TINY = Path(check.__file__).resolve().parents[1] / "testbed" / "start" / "model"
"""a tiny local model with config.json and tokenizer (the testbed's committed start; a 256-token context)"""


def _stand_in(context: int = 4096) -> Path:
    """The tiny model with Qwen2.5-Math's 4096-token context in its config.json, so that the recipes' lengths
    (1024 + 3072) fit it as they fit the real model; its other files are links to the tiny model's."""
    folder = Path(tempfile.mkdtemp(prefix="verl_oar_check_model_"))
    for item in TINY.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((TINY / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    return folder


MODEL = _stand_in()
RECIPE = ["--config-path", str(RECIPES_DIR / "config"), "--config-name"]


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    """Five rows in verl's RL-dataset layout: two ground truths math-verify parses, one only exact match can
    grade ('$'), one empty, one row without a ground truth."""
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    truths = ["42", "\\frac{1}{2}", "$", "", None]
    table = pa.table({
        "data_source": ["math"] * 5,
        "prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(5)],
        "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
    })
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_passes_with_a_local_model(name, train_file):
    overrides = [f"actor_rollout_ref.model.path={MODEL}", f"data.train_files={train_file}"]
    if name.endswith("_oppo_teacher"):  # the teacher's tokenizer is compared with the actor's: a local one
        overrides.append(f"algorithm.oppo.teacher.path={MODEL}")
    status, report = check.check([*RECIPE, name, *overrides])
    assert status == 0, report["refusal"]
    assert report["ok"] and report["refusal"] is None
    estimator = report["estimator"]
    assert ("algorithm.oar" in report["settings"]) == (estimator in ("oar_g", "oar_p"))
    if estimator != "grpo":
        block = report["startup_block"]
        assert f"estimator    {estimator}:" in block and "model        " in block, block  # the memory lines too
        assert report["notes"] == []
    assert report["data"]["rows"] == 5


def test_an_estimator_refusal_exits_1_with_the_message_and_no_traceback(tmp_path):
    argv = [*RECIPE, "qwen2_5_math_1_5b_oar_p", f"actor_rollout_ref.model.path={MODEL}", "trainer.v1.trainer_mode=async"]
    status, report = check.check(argv)
    assert status == 1 and not report["ok"]
    assert report["refusal"]["stage"] == "verl-oar"
    assert "Set trainer.v1.trainer_mode=sync" in report["refusal"]["message"]  # the plugin's own cause and fix
    lines = check.render(report).splitlines()
    assert lines[-2].startswith("REFUSED (verl-oar): algorithm.adv_estimator=oar_p needs per-token")
    assert lines[-1] == "1 problem: the run would not start (exit 1)"


def test_three_problems_at_once_are_all_reported_in_one_pass():
    """One of verl's workers' assumptions (``rollout.n=0``: verl's own checks let it pass, and the recipe's dynamic
    batch size skips its batch-size checks) and two of the plugin's (a mistyped key, a value out of range): every
    one printed with its fix, exit 1. Each alone is also refused: nothing is reported only in company."""
    problems = ["actor_rollout_ref.rollout.n=0", "+algorithm.oar.tua=0.5", "algorithm.oar.perturb_mode=everything"]
    argv = [*RECIPE, "qwen2_5_math_1_5b_oar_g", f"actor_rollout_ref.model.path={MODEL}"]
    status, report = check.check([*argv, *problems])
    assert status == 1 and not report["ok"]
    messages = [p["message"] for p in report["refusals"]]
    assert len(messages) == 3, messages
    assert any("rollout.n=0" in m and "Set rollout.n" in m for m in messages)
    assert any("Unknown key(s) algorithm.oar.tua" in m for m in messages)
    assert any("perturb_mode" in m and "everything" in m for m in messages)
    text = check.render(report)
    assert text.count("REFUSED (") == 3 and text.splitlines()[-1] == "3 problems: the run would not start (exit 1)"
    for problem in problems:
        alone, report = check.check([*argv, problem])
        assert alone == 1 and len(report["refusals"]) == 1, (problem, report["refusals"])


@pytest.mark.parametrize(("overrides", "needle"), [
    (["actor_rollout_ref.rollout.n=1"], "rollout.n=1 with algorithm.adv_estimator=oar_g"),
    (["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.ppo_mini_batch_size=1"], "does not split over 3"),
    (["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16"], "would not fill one mini-batch"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=false", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
     "not a multiple of actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"),
    (["data.max_response_length=4000"], "more than the model's context (4096"),
])
def test_what_verls_workers_assume_is_checked_with_dynamic_batch_size_or_not(overrides, needle):
    argv = [*RECIPE, "qwen2_5_math_1_5b_oar_g", f"actor_rollout_ref.model.path={MODEL}", *overrides]
    status, report = check.check(argv)
    assert status == 1 and any(needle in p["message"] for p in report["refusals"]), report["refusals"]


def test_a_bad_oar_key_and_a_bad_override_are_refusals_not_stack_traces(capsys):
    status, report = check.check([*RECIPE, "qwen2_5_math_1_5b_oar_g", "+algorithm.oar.tauu=0.3"])
    assert status == 1 and "Unknown key(s) algorithm.oar.tauu" in report["refusal"]["message"]
    status, report = check.check([*RECIPE, "qwen2_5_math_1_5b_oar_g", "algorithm.not_a_key=1"])
    assert status == 1 and report["refusal"]["stage"] == "hydra"
    assert "not_a_key" in report["refusal"]["message"] and "+key=value" in report["refusal"]["message"]
    assert "Traceback" not in capsys.readouterr().err


def test_ground_truths_and_responses_are_counted_with_the_package_reward_and_locator(train_file, tmp_path):
    responses = tmp_path / "responses.jsonl"
    texts = ["so \\boxed{42}", "The answer is 7.", "no answer here", "#### 5"]
    responses.write_text("\n".join(json.dumps({"response": t}) for t in texts) + "\n")
    argv = [*RECIPE, "qwen2_5_math_1_5b_oar_g", f"actor_rollout_ref.model.path={MODEL}",
            f"data.train_files={train_file}", "--responses", str(responses)]
    status, report = check.check(argv)
    assert status == 0, report["refusal"]
    assert report["data"]["ground_truths"] == {"math_verify": 2, "exact_only": 1, "missing": 2}
    assert report["responses"] == {"file": str(responses), "responses": 4, "found": 3,
                                   "locator": "built-in find_answer_span"}
    text = check.render(report)
    assert "ground truths: 2 parsed by math-verify, 1 gradable by exact match only, 2 missing" in text
    assert "found 3 of 4 answers" in text and text.endswith("OK: the run would start (exit 0)")
    # --sample limits the rows read
    _, report = check.check([*argv, "--sample", "2"])
    assert report["data"]["rows"] == 2 and report["data"]["ground_truths"] == {"math_verify": 2, "exact_only": 0,
                                                                                "missing": 0}


def test_a_train_file_without_the_prompt_column_is_refused(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["q"], "reward_model": [{"ground_truth": "1"}]}), path)
    status, report = check.check([*RECIPE, "qwen2_5_math_1_5b_grpo", f"data.train_files={path}"])
    assert status == 1 and report["refusal"]["stage"] == "data"
    assert "no column 'prompt'" in report["refusal"]["message"] and "data.prompt_key" in report["refusal"]["message"]


def test_a_hub_id_not_in_the_cache_skips_the_memory_lines_without_downloading():
    status, report = check.check([*RECIPE, "qwen2_5_math_1_5b_oar_p",
                                  "actor_rollout_ref.model.path=no-such-org/no-such-model-h9"])
    assert status == 0, report["refusal"]
    assert "not a local folder and not in the hub cache" in report["notes"][0] and "nothing downloaded" in report["notes"][0]
    block = report["startup_block"]
    assert "OAR-P (occlusion), perturb_mode=chunk, K=16" in block and "model        " not in block


def test_json_flag_prints_the_report_alone_on_stdout(capsys, monkeypatch):
    """Through the module's main: stdout is one JSON document (verl's own prints go to stderr)."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # main sets them (offline by default); restored after
        monkeypatch.setenv(key, "1")
    status = check.main([*RECIPE, "qwen2_5_math_1_5b_oar_g", f"actor_rollout_ref.model.path={MODEL}", "--json"])
    out = capsys.readouterr()
    assert status == 0, out.err[-3000:]
    report = json.loads(out.out)
    assert report["ok"] and report["estimator"] == "oar_g" and report["settings"]["algorithm.oar"]["tau"] == 0.5
    assert "[validate_config]" in out.err  # verl's print, kept off stdout


def test_gpu_memory_predicts_the_workers_memory_check():
    """--gpu-memory runs the workers' own verdict (memory_check.worker_verdict) on a GPU of that size: the tiny
    model fits 80 GiB; on 1 GiB the 2 GiB reserve alone leaves nothing, so the workers would stop: exit 1."""
    argv = [*RECIPE, "qwen2_5_math_1_5b_oar_g", f"actor_rollout_ref.model.path={MODEL}"]
    status, report = check.check([*argv, "--gpu-memory", "80"])
    assert status == 0 and "memory check: oar_g fits: GPU 80.0 GiB" in report["memory_verdict"]
    status, report = check.check([*argv, "--gpu-memory", "1"])
    assert status == 1 and report["refusal"]["stage"] == "memory"
    message = report["refusal"]["message"]
    assert message.startswith("predicted for a 1 GiB GPU") and "cannot fit this GPU" in message
    assert "Bring it down with one of" in message  # the knobs, as the workers would list them


def test_a_relative_config_path_is_resolved_as_main_ppo_does(monkeypatch):
    """main_ppo's Hydra reads a relative --config-path under verl/trainer/ (checked: `python -m
    verl.trainer.main_ppo --config-path=recipes/config ...` from the repository root fails with 'config directory
    .../verl/trainer/recipes/config' not found); the check refuses it the same way and gives the absolute path."""
    monkeypatch.chdir(RECIPES_DIR.parent)
    status, report = check.check(["--config-path", "recipes/config", "--config-name", "qwen2_5_math_1_5b_grpo"])
    assert status == 1 and report["refusal"]["stage"] == "hydra"
    assert f"Give an absolute path: --config-path={RECIPES_DIR / 'config'}" in report["refusal"]["message"]
