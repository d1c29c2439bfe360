"""Math data preprocessing (verl_oar.data): tiny local fixtures in each source's schema (a parquet
file, jsonl files, a ``save_to_disk`` DatasetDict, a folder of parquet files) go through the CLI, and
verl's own ``RLHFDataset`` loads what comes out. No hub access: every source is local."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pandas as pd
import pytest

from verl_oar.data import prepare_math
from verl_oar.data.math_sources import INSTRUCTION, SOURCES
from verl_oar.data.prepare_math import main

MATH_ROWS = [  # DigitalLearningGmbH/MATH-lighteval: problem, level ("Level N"), type, solution
    {"problem": "Compute $1/2+1/4$.", "level": "Level 3", "type": "Algebra",
     "solution": "We add: $\\frac{1}{2}+\\frac{1}{4}=\\boxed{\\frac{3}{4}}$."},
    {"problem": "Easy one.", "level": "Level 1", "type": "Algebra", "solution": "$\\boxed{1}$"},
    {"problem": "Also easy.", "level": "Level 2", "type": "Algebra", "solution": "$\\boxed{2}$"},
    {"problem": "Nested.", "level": "Level 5", "type": "Precalculus",
     "solution": "First $\\boxed{0}$ is wrong; the point is $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$."},
    {"problem": "No box.", "level": "Level 4", "type": "Geometry", "solution": "The answer is 7."},
    {"problem": "Unknown level.", "level": "Level ?", "type": "Geometry", "solution": "$\\boxed{5}$"},
    {"problem": "Framed.", "level": "Level 4", "type": "Number Theory", "solution": "So $\\fbox{12}$."},
]
GSM8K_TRAIN = [  # openai/gsm8k (main): question, answer ending in "#### <number>"
    {"question": "Natalia sold 48 clips...", "answer": "48/2 = <<48/2=24>>24\n#### 72"},
    {"question": "How many cents?", "answer": "100*12 = <<100*12=1200>>1200\n#### 1,200"},
    {"question": "Broken row.", "answer": "no final answer here"},
]
GSM8K_TEST = [{"question": "Janet's ducks...", "answer": "16-3-4=9\n#### 18"}]
MATH500 = [  # HuggingFaceH4/MATH-500: problem, solution, answer, subject, level (int), unique_id
    {"problem": "Convert $(0,3)$ to polar.", "solution": "... $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
     "unique_id": "test/precalculus/807.json"},
    {"problem": "Empty answer.", "solution": "", "answer": "  ", "subject": "Algebra", "level": 1,
     "unique_id": "test/algebra/1.json"},
]
AIME24 = [  # HuggingFaceH4/aime_2024: id, problem, solution, answer (string), url, year
    {"id": 60, "problem": "Every morning Aya goes for a walk...", "solution": "...", "answer": "204",
     "url": "https://artofproblemsolving.com/...", "year": "2024"},
]
AMC23 = [  # math-ai/amc23: question, answer (may be a float)
    {"id": 0, "question": "Cities A and B are 45 miles apart...", "answer": 27.0, "url": "https://..."},
    {"id": 1, "question": "Positive reals x, y...", "answer": 36.0, "url": "https://..."},
]
MINERVA = [  # math-ai/minervamath: question, answer
    {"question": "Each of the two Magellan telescopes...", "answer": "1.6"},
    {"question": "", "answer": "3"},
]


def _write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    """datasets' cache in a temporary directory (it caches the Arrow form of local files)."""
    cache = tmp_path_factory.mktemp("hf_datasets_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory, hf_cache) -> dict[str, str]:
    """``--source`` values for every source, one local format or another."""
    root = tmp_path_factory.mktemp("raw")
    pd.DataFrame(MATH_ROWS).to_parquet(root / "math.parquet")                     # a parquet file
    gsm8k = root / "gsm8k_saved"                                                   # save_to_disk
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K_TRAIN),
                          "test": datasets.Dataset.from_list(GSM8K_TEST)}).save_to_disk(str(gsm8k))
    _write_jsonl(MATH500, root / "math500.jsonl")                                  # jsonl files
    _write_jsonl(AMC23, root / "amc23.jsonl")
    pd.DataFrame(AIME24).to_parquet(root / "aime24.parquet")
    (root / "minerva").mkdir()                                                     # a folder of parquet
    pd.DataFrame(MINERVA).to_parquet(root / "minerva" / "test-00000-of-00001.parquet")
    return {
        "math_l3to5": str(root / "math.parquet"), "gsm8k": str(gsm8k), "gsm8k_test": str(gsm8k),
        "math500": str(root / "math500.jsonl"), "aime24": str(root / "aime24.parquet"),
        "amc23": str(root / "amc23.jsonl"), "minerva": str(root / "minerva"),
    }


def _source_args(values: dict[str, str]) -> list[str]:
    return [arg for name, value in values.items() for arg in ("--source", f"{name}={value}")]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, fixtures) -> tuple[Path, str]:
    """The CLI run once on every fixture: (output directory, printed summary)."""
    out = tmp_path_factory.mktemp("prepared")
    buffer = io.StringIO()                     # module scope has no capsys
    with contextlib.redirect_stdout(buffer):
        assert main(["--out", str(out), *_source_args(fixtures)]) == 0
    return out, buffer.getvalue()


def _read(path: Path) -> list[dict]:
    return datasets.Dataset.from_parquet(str(path)).to_list()


# ---------------------------------------------------------------------------------------------
# The files and their rows
# ---------------------------------------------------------------------------------------------


def test_files_and_counts(prepared):
    out, _ = prepared
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["train.parquet", "math500.parquet", "aime24.parquet", "amc23.parquet", "minerva.parquet", "gsm8k_test.parquet"]
    )
    counts = {p.stem: len(_read(p)) for p in out.iterdir()}
    # MATH: 3 rows at levels 3-5 with a box (L1, L2, "Level ?" filtered; the unboxed L4 dropped); GSM8K: 2 of 3
    assert counts == {"train": 3 + 2, "math500": 1, "aime24": 1, "amc23": 2, "minerva": 1, "gsm8k_test": 1}


def test_row_format(prepared):
    out, _ = prepared
    for path in out.iterdir():
        for row in _read(path):
            assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
            assert row["ability"] == "math"
            assert row["reward_model"]["style"] == "rule"
            assert isinstance(row["reward_model"]["ground_truth"], str) and row["reward_model"]["ground_truth"]
            [message] = row["prompt"]
            assert message["role"] == "user"
            assert message["content"] == f"{row['extra_info']['question']}\n{INSTRUCTION}"
            assert set(row["extra_info"]) == {"split", "index", "question", "answer", "level"}
            assert SOURCES[row["data_source"]].output == path.stem


def test_ground_truths_and_levels(prepared):
    out, _ = prepared
    train = _read(out / "train.parquet")
    truths = {(r["data_source"], r["extra_info"]["index"]): r["reward_model"]["ground_truth"] for r in train}
    assert truths == {
        ("math_l3to5", 0): "\\frac{3}{4}",
        ("math_l3to5", 3): "\\left( 3, \\frac{\\pi}{2} \\right)",     # the last box, nested braces
        ("math_l3to5", 6): "12",                                          # \fbox
        ("gsm8k", 0): "72",
        ("gsm8k", 1): "1200",                                             # thousands separator removed
    }
    assert {r["extra_info"]["level"] for r in train if r["data_source"] == "math_l3to5"} == {3, 4, 5}
    assert {r["extra_info"]["level"] for r in train if r["data_source"] == "gsm8k"} == {None}
    assert [r["reward_model"]["ground_truth"] for r in _read(out / "amc23.parquet")] == ["27", "36"]
    assert _read(out / "aime24.parquet")[0]["reward_model"]["ground_truth"] == "204"
    assert _read(out / "gsm8k_test.parquet")[0]["reward_model"]["ground_truth"] == "18"
    assert _read(out / "gsm8k_test.parquet")[0]["extra_info"]["split"] == "test"
    math500 = _read(out / "math500.parquet")[0]
    assert math500["reward_model"]["ground_truth"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert math500["extra_info"]["level"] == 2


def test_summary_counts_everything(prepared):
    _, summary = prepared
    lines = {line.split()[0]: line for line in summary.splitlines()[1:] if line.startswith("    ")}
    assert "read 7, kept 3, filtered by level 3, dropped (no_answer) 1" in lines["math_l3to5"]
    assert "read 3, kept 2, dropped (no_answer) 1" in lines["gsm8k"]
    assert "dropped (no_answer) 1" in lines["math500"]
    assert "dropped (empty_problem) 1" in lines["minerva"]
    assert "[test]" in lines["gsm8k_test"] and "[train]" in lines["gsm8k"]   # splits of the saved DatasetDict
    assert "train.parquet: 5 rows" in summary


def test_train_shuffle_is_fixed(tmp_path, fixtures, prepared, capsys):
    argv = ["--out", str(tmp_path), "--only", "train", *_source_args(fixtures)]
    assert main(argv) == 0
    assert _read(tmp_path / "train.parquet") == _read(prepared[0] / "train.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.parquet"]


def test_only_eval_and_max_rows(tmp_path, fixtures, capsys):
    assert main(["--out", str(tmp_path), "--only", "eval", "--max-rows", "1", *_source_args(fixtures)]) == 0
    assert sorted(p.stem for p in tmp_path.iterdir()) == sorted(["math500", "aime24", "amc23", "minerva", "gsm8k_test"])
    assert len(_read(tmp_path / "amc23.parquet")) == 1
    assert "read 1, kept 1" in capsys.readouterr().out


def test_hub_names_are_the_defaults(monkeypatch, tmp_path):
    """Without --source a hub dataset is read, with the entry's config and split."""
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(GSM8K_TEST)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    rows, counts = prepare_math.source_rows(SOURCES["gsm8k_test"], None, None)
    assert calls == [("openai/gsm8k", "main", "test")] and counts.kept == 1 and rows[0]["data_source"] == "gsm8k_test"
    assert {s.hub for s in SOURCES.values()} == {
        "DigitalLearningGmbH/MATH-lighteval", "openai/gsm8k", "HuggingFaceH4/MATH-500", "HuggingFaceH4/aime_2024",
        "math-ai/amc23", "math-ai/minervamath",
    }


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Fix:" in err
    return err


def test_errors(tmp_path, fixtures, capsys, monkeypatch):
    out = ["--out", str(tmp_path / "out")]
    assert "unknown source 'math'" in _error([*out, "--source", "math=x.parquet"], capsys)
    assert "is not NAME=PATH_OR_HUB" in _error([*out, "--source", "gsm8k"], capsys)
    err = _error([*out, "--only", "eval", "--source", f"math500={tmp_path / 'missing.jsonl'}"], capsys)
    assert "no such file or directory" in err and "math500" in err
    # a GSM8K file given as MATH: no 'problem' column, and the columns found are listed
    gsm_file = _write_jsonl(GSM8K_TRAIN, tmp_path / "gsm.jsonl")
    err = _error([*out, "--only", "train", "--source", f"math_l3to5={gsm_file}"], capsys)
    assert "no problem column" in err and "['question', 'answer']" in err
    # a saved DatasetDict without the wanted split
    saved = tmp_path / "no_test_split"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K_TRAIN),
                          "validation": datasets.Dataset.from_list(GSM8K_TEST)}).save_to_disk(str(saved))
    sources = {**fixtures, "gsm8k_test": str(saved)}
    err = _error([*out, "--only", "eval", *_source_args(sources)], capsys)
    assert "no split 'test'" in err and "'validation'" in err
    # a hub dataset that cannot be loaded names the source and the offline fix
    real_load_dataset = datasets.load_dataset

    def load_dataset(path, *args, **kwargs):
        if path == "someone/aime":
            raise ConnectionError("offline")
        return real_load_dataset(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    err = _error([*out, "--only", "eval", *_source_args({**fixtures, "aime24": "someone/aime"})], capsys)
    assert "'someone/aime'" in err and "save_to_disk" in err
    monkeypatch.undo()
    # an unreadable local file names the file
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    err = _error([*out, "--only", "train", "--source", f"math_l3to5={broken}"], capsys)
    assert "cannot read" in err and "broken.jsonl" in err
    # every row dropped: an error, not an empty file
    bad = _write_jsonl([{"question": "q", "answer": "no hashes"}], tmp_path / "bad.jsonl")
    err = _error([*out, "--only", "eval", *_source_args({**fixtures, "gsm8k_test": str(bad)})], capsys)
    assert "gsm8k_test.parquet would be empty" in err
    assert not (tmp_path / "out" / "gsm8k_test.parquet").exists()


def test_cli_subprocess(tmp_path, fixtures, hf_cache):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(hf_cache)}
    done = subprocess.run(
        [sys.executable, "-m", "verl_oar.data.prepare_math", "--out", str(tmp_path), "--only", "eval",
         *_source_args(fixtures)],
        check=False, capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "aime24.parquet: 1 rows" in done.stdout
    assert (tmp_path / "minerva.parquet").exists()


# ---------------------------------------------------------------------------------------------
# verl's dataset loader accepts the files
# ---------------------------------------------------------------------------------------------


def test_verl_rlhf_dataset_loads_them(prepared, tmp_path):
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    from verl_oar.cpu.workspace import build_tokenizer

    out, _ = prepared
    tokenizer = build_tokenizer()
    config = OmegaConf.create({
        "prompt_key": "prompt", "max_prompt_length": 1024, "filter_overlong_prompts": True,
        "filter_overlong_prompts_workers": 1, "truncation": "error", "cache_dir": str(tmp_path / "verl_cache"),
    })
    files = [str(out / "train.parquet"), str(out / "math500.parquet"), str(out / "gsm8k_test.parquet")]
    dataset = RLHFDataset(files, tokenizer, config)
    assert len(dataset) == 5 + 1 + 1

    item = dataset[0]
    train_rows = _read(out / "train.parquet")
    assert item["reward_model"]["ground_truth"] == train_rows[0]["reward_model"]["ground_truth"]
    assert item["data_source"] == train_rows[0]["data_source"]
    assert item["raw_prompt"][0]["content"].endswith(INSTRUCTION)
    # verl 0.9.1's dataset returns the chat (its agent loop tokenizes it); tokenize it the way the
    # dataset's own prompt-length filter does
    input_ids = tokenizer.apply_chat_template(item["raw_prompt"], add_generation_prompt=True, tokenize=True)
    input_ids = input_ids["input_ids"] if isinstance(input_ids, dict) or hasattr(input_ids, "keys") else input_ids
    assert 0 < len(input_ids) <= 1024
    assert INSTRUCTION in tokenizer.decode(input_ids)

    batch = next(iter(DataLoader(dataset, batch_size=4, collate_fn=collate_fn)))
    assert batch["dummy_tensor"].shape[0] == 4
    assert [gt["ground_truth"] for gt in batch["reward_model"]] == [
        r["reward_model"]["ground_truth"] for r in train_rows[:4]
    ]
