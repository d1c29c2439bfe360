"""OPPO's teacher on the pick_max testbed (``verl_oar.testbed.teacher``): the committed teacher belongs to the
committed start and reads the hint (its evidence, measured again here, is what teacher.json says: positive
on right picks, negative on wrong ones, near 0 on fillers), the oracle prompt is rendered as the privileged
pass renders it, a teacher of another start is refused with the build command, and the build's mechanics."""

from __future__ import annotations

import json

import pytest
import torch

from verl_oar.core.privileged_prompt import OPPO_ORACLE
from verl_oar.testbed.teacher import MANIFEST, TeacherSpec, build_teacher, check_teacher, evidence_statistics, hinted_prompt_ids
from verl_oar.testbed.workspace import committed_testbed, copy_testbed, max_response_tokens, sample_responses, split_problems


@pytest.mark.parametrize("variant", [None, "fill32"])  # the committed start's teacher; the study's longest task's
def test_the_committed_teacher_reads_the_hint_as_teacher_json_says(variant):
    from transformers import AutoModelForCausalLM

    from verl_oar.cpu.workspace import build_tokenizer
    from verl_oar.testbed.variants import load_variant

    bed = committed_testbed() if variant is None else load_variant(variant)
    assert check_teacher(bed) == bed.teacher_dir
    manifest = json.loads((bed.teacher_dir / MANIFEST).read_text())
    recorded = manifest["val_samples"]
    tokenizer = build_tokenizer()
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    start, teacher = load(bed.model_dir), load(bed.teacher_dir)
    _, val = split_problems(bed.spec)
    problems = val[:16]
    sampled = sample_responses(start, tokenizer, [p.prompt for p in problems], seed=manifest["spec"]["seed"],
                               max_new_tokens=max_response_tokens(bed.spec))
    taught, own = (evidence_statistics(m, tokenizer, problems, sampled) for m in (teacher, start))
    assert taught["right_pick_count"] > 0 and taught["wrong_pick_count"] > 0
    assert taught["right_pick"] > 0.1 and taught["wrong_pick"] < -2.0 and taught["filler_abs"] < 0.2, taught
    assert own["filler_abs"] > 5 * taught["filler_abs"], own  # the start itself cannot read the hint
    for key in ("right_pick", "wrong_pick", "filler_abs"):  # the build's statistics (64 prompts) agree in sign and size
        assert recorded["evidence_teacher"][key] == pytest.approx(taught[key], abs=max(0.5, 0.3 * abs(taught[key])))
    assert recorded["greedy_accuracy_hinted"] > 0.9 > recorded["greedy_accuracy_plain"]


def test_the_oracle_prompt_is_the_chat_rendered_oppo_template():
    from verl_oar.cpu.workspace import build_tokenizer, chat_prompt_ids

    tokenizer = build_tokenizer()
    ids = hinted_prompt_ids(tokenizer, "max: 3 7 | 2 5", "75")
    assert ids == chat_prompt_ids(tokenizer, OPPO_ORACLE.replace("{question}", "max: 3 7 | 2 5").replace("{answer}", "75"))
    assert "The correct final answer is: 75." in tokenizer.decode(ids)


def test_a_missing_or_foreign_teacher_is_refused_with_the_build_command(tmp_path):
    bed = copy_testbed(committed_testbed(), tmp_path / "bed")
    manifest = json.loads((bed.teacher_dir / MANIFEST).read_text())
    (bed.teacher_dir / MANIFEST).write_text(json.dumps({**manifest, "start_fingerprint": "another"}))
    with pytest.raises(SystemExit, match="one built from start another.*python -m verl_oar.testbed.teacher"):
        check_teacher(bed)
    (bed.teacher_dir / MANIFEST).unlink()
    with pytest.raises(SystemExit, match="no OPPO teacher"):
        check_teacher(bed)


def test_build_teacher_writes_a_loadable_teacher_and_its_manifest(tmp_path):
    from transformers import AutoModelForCausalLM

    bed = copy_testbed(committed_testbed(), tmp_path / "bed")
    manifest = build_teacher(bed, TeacherSpec(steps=3, batch_size=4, stats_samples=2))
    assert check_teacher(bed) == bed.teacher_dir and manifest["start_fingerprint"] == bed.manifest["fingerprint"]
    assert json.loads((bed.teacher_dir / MANIFEST).read_text())["spec"]["steps"] == 3
    assert manifest["val_samples"]["samples"] == 2 and manifest["machine"]["cpu"]
    AutoModelForCausalLM.from_pretrained(bed.teacher_dir)
