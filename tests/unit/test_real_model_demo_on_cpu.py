"""app.real_demo's report: the metric file read as verl's file logger writes it, and the page rendered from the
summary alone (every number of the page is one of the summary's)."""

from __future__ import annotations

import json

from verl_oar.app import real_demo as demo


def test_training_steps_are_read_from_verls_metric_file_and_validation_lines_are_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [{"step": 0, "data": {"val-core/x/acc/mean@1": 0.2}},
             {"step": 1, "data": {"critic/score/mean": 0.25, "response_length/mean": 61.5, "timing_s/step": 70.1,
                                  "actor/entropy": 1.0}},
             {"step": 2, "data": {"critic/score/mean": 0.5, "timing_s/step": 66.0}}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert demo._read_metrics(path) == [
        {"step": 1, "critic/score/mean": 0.25, "response_length/mean": 61.5, "timing_s/step": 70.1},
        {"step": 2, "critic/score/mean": 0.5, "timing_s/step": 66.0}]
    assert demo._read_metrics(tmp_path / "missing.jsonl") == []


def test_the_page_shows_the_summary(tmp_path):
    summary = {"model": "SmolLM2", "command": "python -m verl_oar.app.real_demo --steps 1", "machine": {"cores": 2},
               "rollout": "vllm",
               "training": {"oar_g": {"rollout": "vllm", "seconds": 95, "steps": [{"step": 1, "critic/score/mean": 0.125,
                                                                  "response_length/mean": 60.0, "timing_s/step": 71.5}]}},
               "sampling": {"responses": 4, "right": 1, "sampler": "transformers generate"},
               "counterfactual": [{"row": 2, "score": 0.0, "reasoning_tokens": 30,
                                   "delete_top_10%": dict(zip(demo.RANKED, (-1.5, -0.25, -2.0, 0.125, 0.0)))}],
               "heatmaps": [{"label": "wrong", "row": 2, "png": "heatmap_wrong/heatmap_2.png"}]}
    page = demo.render(summary)
    for text in ("Training (main_ppo, vllm rollout)", "oar_g: 95 s", "<td>0.125</td>", "<td>71.5</td>", "4 sampled (transformers generate), 1 right",
                 "<td>-1.50</td>", "<td>-0.25</td>", "<td>-2.00</td>", "<td>+0.12</td>",
                 "src='heatmap_wrong/heatmap_2.png'", "python -m verl_oar.app.real_demo --steps 1"):
        assert text in page, text
