"""Two data-parallel ranks (gloo, CPU) of verl's real FSDP2 engine, parameters sharded, where a check of rank 1's
rows fails inside verl-oar's fused OAR-G old-log-prob pass, once per case:

* ``locator``: the answer locator (``algorithm.oar.answer_locator``, :func:`locate_or_fail` below) raises on a
  response only rank 1 has, before the pass's first collective;
* ``check``: ``core.hf.OutcomeHead.check`` fails on rank 1's rows (its outcome logits differ from the model's own,
  as for a model that post-processes its logits; here ``OutcomeHead.logits`` is scaled on rank 1 only), after the
  pass's first forward, with the all-gathers of the noisy forward and backward still to come;
* ``in_step``: a plain pass on both ranks afterwards (the ranks' collectives still meet).

Without agreement the other rank waits in a collective (a hang under NCCL). So the ranks are driven by files,
never by a collective of their own: the launcher starts a case once both ranks finished the previous one, and
gives each case ``CASE_LIMIT`` seconds; a rank that has not finished by then is reported as hung and both are
killed (a failed rank stays alive meanwhile, as a Ray worker would). Prints one ``RESULT {json}`` line:
``{"ranks": {rank: {case: {"error" or "ok", "seconds"}}}, "hung": null or {"case", "ranks", "after_s"}}``.

    VERL_PLATFORM=cpu python tests/engine/engine_rank_error_check.py OUT_DIR [CASE ...]   # launcher
    (a rank: ... engine_rank_error_check.py OUT_DIR --rank R --port P CASE ...)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
CASES = ("locator", "check", "in_step")
CASE_LIMIT = 90.0
"""seconds a case may take on a rank before it counts as hung (the test asks for under 60 s)"""
BUILD_LIMIT = 400.0
RANK_DATA = {  # both ranks' answers are found by the built-in locator
    0: (["What is 3+4?", "What is 8+5?"],
        ["3 plus 4: count 3, then 4 more, 5, 6, 7. So the sum is \\boxed{7}",
         "We add the units: 8+5=13, carry 1, so \\boxed{13}."]),
    1: (["What is 10-4?", "What is 2*3?"],
        ["Ten minus four is six.\n#### 6", "Two times three: 2+2+2, so \\boxed{6}"]),
}
LOCATOR_MESSAGE = "this locator cannot read 'Ten minus four'"
"""what :func:`locate_or_fail` raises on rank 1's first response"""


def locate_or_fail(text: str):
    """An answer locator (``/path/file.py:function`` form) that fails on one of rank 1's responses only."""
    from verl_oar.core.answer_span import find_answer_span

    if "Ten minus four" in text:
        raise ValueError(LOCATOR_MESSAGE)
    return find_answer_span(text)


def _touch(path: str, payload: dict | None = None) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(payload or {}, f)
    os.replace(path + ".tmp", path)


def _wait_for(path: str, limit: float = 900.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never came")
        time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out_dir: str, cases: list[str]) -> dict:
    """Build the model, start both ranks, run ``cases`` one at a time; kill the ranks at the end or on a hang."""
    sys.path.insert(0, HERE)
    from engine_importance_check import build_model_dir

    build_model_dir(out_dir)
    port = str(_free_port())
    logs = [open(os.path.join(out_dir, f"rank{r}.log"), "w") for r in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), out_dir, "--rank", str(r), "--port", port,
                               *cases], stdout=logs[r], stderr=subprocess.STDOUT, cwd=HERE)
             for r in range(WORLD)]
    result: dict = {"ranks": {r: {} for r in range(WORLD)}, "hung": None, "crashed": None}

    def wait(names: list[str], limit: float) -> list[int]:
        """The ranks whose file ``name`` (one per rank) is still missing after ``limit`` s (early if one died)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            missing = [r for r, name in enumerate(names) if not os.path.exists(os.path.join(out_dir, name))]
            if not missing:
                return []
            dead = [r for r in missing if procs[r].poll() is not None]
            if dead:
                result["crashed"] = {"ranks": dead, "codes": [procs[r].returncode for r in dead]}
                return missing
            time.sleep(0.2)
        return missing

    try:
        missing = wait([f"ready{r}" for r in range(WORLD)], BUILD_LIMIT)
        if missing and result["crashed"] is None:
            result["hung"] = {"case": "build", "ranks": missing, "after_s": BUILD_LIMIT}
        for case in cases if not missing else []:
            _touch(os.path.join(out_dir, f"go_{case}"))
            missing = wait([f"{case}{r}.json" for r in range(WORLD)], CASE_LIMIT)
            for r in range(WORLD):
                if r not in missing:
                    with open(os.path.join(out_dir, f"{case}{r}.json")) as f:
                        result["ranks"][r][case] = json.load(f)
            if missing:
                if result["crashed"] is None:
                    result["hung"] = {"case": case, "ranks": missing, "after_s": CASE_LIMIT}
                break
        _touch(os.path.join(out_dir, "stop"))
        for proc in procs:
            try:
                proc.wait(timeout=5 if result["hung"] or result["crashed"] else 60)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    if result["hung"] or result["crashed"]:
        for r in range(WORLD):
            with open(os.path.join(out_dir, f"rank{r}.log")) as f:
                result.setdefault("logs", {})[r] = f.read()[-3000:]
    return result


@contextmanager
def _case(name: str, rank: int, oar: dict):
    """What case ``name`` changes on ``rank`` for the duration of its pass."""
    if name == "locator":
        oar["answer_locator"] = f"{os.path.abspath(__file__)}:locate_or_fail"
    if name != "check" or rank != 1:
        yield
        return
    from verl_oar.core.hf import OutcomeHead

    own = OutcomeHead.logits
    OutcomeHead.logits = lambda self, hidden: own(self, hidden) * 1.5
    try:
        yield
    finally:
        OutcomeHead.logits = own


def run_rank(out_dir: str, rank: int, port: str, cases: list[str]) -> None:
    os.environ.update(VERL_PLATFORM="cpu", RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    sys.path.insert(0, HERE)
    import engine_importance_check as base
    import torch
    from transformers import AutoTokenizer
    from verl.utils import tensordict_utils as tu

    model_dir = os.path.join(out_dir, "tiny_model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base.PROMPTS[:], base.RESPONSES[:] = RANK_DATA[rank]
    worker = base.build_worker(model_dir, use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=1,
                               param_offload=False)
    _touch(os.path.join(out_dir, f"ready{rank}"))
    for name in cases:
        _wait_for(os.path.join(out_dir, f"go_{name}"))
        oar = {"objective": "noisy_kl", "saliency": "grad_x_input", "outcome": "mean"}
        start = time.monotonic()
        try:
            with _case(name, rank, oar):
                data, _, _ = base.make_batch(tokenizer, oar, step=3)
                tu.assign_non_tensor(data, oar_method="gradient", calculate_entropy=True, compute_loss=False,
                                     oar_fused=True)
                out = worker.compute_log_prob(data)
            outcome = {"ok": bool(torch.isfinite(out["oar_importance"].values()).all())}
        except Exception as error:  # noqa: BLE001 - the case's outcome
            outcome = {"error": f"{type(error).__name__}: {error}"}
        outcome["seconds"] = time.monotonic() - start
        _touch(os.path.join(out_dir, f"{name}{rank}.json"), outcome)
    _wait_for(os.path.join(out_dir, "stop"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if "--rank" in sys.argv:
        i = sys.argv.index("--rank")
        run_rank(sys.argv[1], int(sys.argv[i + 1]), sys.argv[i + 3], sys.argv[i + 4:])
    else:
        print("RESULT " + json.dumps(launch(sys.argv[1], sys.argv[2:] or list(CASES))), flush=True)
