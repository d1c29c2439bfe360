"""Two data-parallel ranks (gloo, CPU) of verl's real FSDP2 engine scoring different data: OAR-P
(chunk mode) and non-fused OAR-G, whose numbers of model calls differ between the ranks. Each rank's
importance must equal a one-process plain-transformers reference, and the parameters must come
back unchanged and sharded. Prints one ``RANK {json}`` line per rank.

    VERL_PLATFORM=cpu python tests/engine/engine_multirank_check.py OUT_DIR       # launcher: spawns 2 ranks
    (a rank: ... engine_multirank_check.py OUT_DIR --rank R --port P)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
# rank 0: long responses (several chunks, several OAR-P calls); rank 1: first a micro-batch with no
# answer (OAR-G makes no forward, OAR-P only its clean pass), then an answer-first response.
RANK_DATA = {
    0: (["What is 3+4?", "What is 8+5?"],
        ["3 plus 4: count 3, then 4 more, 5, 6, 7. So the sum is \\boxed{7}",
         "We add the units: 8+5=13, carry 1, so \\boxed{13}."]),
    1: (["What is 2*3?", "What is 10-4?"],
        ["I am not sure about this one", "Ten minus four is six.\n#### 6"]),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out_dir: str, timeout: float) -> int:
    """Build the model, run both ranks, echo their output; exit code 0 iff both ranks exited 0."""
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    sys.path.insert(0, HERE)
    from engine_importance_check import build_model_dir

    build_model_dir(out_dir)
    port = str(_free_port())
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), out_dir, "--rank", str(r), "--port", port],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE)
        for r in range(WORLD)
    ]
    codes = []
    for r, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            print(f"TIMEOUT rank {r} after {timeout} s (collective mismatch between ranks?)", flush=True)
            return 124
        sys.stdout.write(out)
        if proc.returncode:
            sys.stderr.write(f"--- rank {r} stderr ---\n{err[-4000:]}\n")
        codes.append(proc.returncode)
    return max(abs(c) for c in codes)


def _count_fsdp_collectives() -> dict:
    """Count FSDP2's all-gathers and reduce-scatters (torch 2.13 calls ``dist.all_gather_single`` /
    ``dist.reduce_scatter_single`` through the module attribute) by name; returns the live counter."""
    import torch.distributed as dist

    counts: dict = {}
    for name in ("all_gather_single", "reduce_scatter_single"):
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return counts


def run_rank(out_dir: str, rank: int, port: str) -> None:
    os.environ.update(VERL_PLATFORM="cpu", RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    sys.path.insert(0, HERE)
    import engine_importance_check as base
    import torch
    from engine_perturbation_check import naive_reference
    from torch.distributed.tensor import DTensor
    from transformers import AutoTokenizer
    from verl.utils import tensordict_utils as tu

    from verl_oar.engines.fsdp.unshard import fsdp2_modules

    model_dir = os.path.join(out_dir, "tiny_model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base.PROMPTS[:], base.RESPONSES[:] = RANK_DATA[rank]
    worker = base.build_worker(model_dir, use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=1,
                               param_offload=False)
    engine = worker.actor.engine
    assert torch.distributed.get_world_size() == WORLD
    before = base.snapshot(engine)
    counts = _count_fsdp_collectives()
    temperature = 0.8
    p_oar = {"outcome": "mean", "perturb_mode": "chunk", "perturb_budget": 3}
    data, prompts, responses = base.make_batch(tokenizer, p_oar, step=1)
    tu.assign_non_tensor(data, oar_method="perturbation", temperature=temperature, oar_config=p_oar, oar_step=1)
    p_out = worker.compute_token_importance(data)
    p_calls = dict(counts)
    counts.clear()
    g_oar = {"objective": "noisy_kl", "saliency": "grad_x_input", "outcome": "mean"}
    data, _, _ = base.make_batch(tokenizer, g_oar, step=3)
    g_out = worker.compute_token_importance(data)  # oar_method defaults to gradient, not fused
    g_calls = dict(counts)
    after = base.snapshot(engine)
    sharded = all(isinstance(p, DTensor) for p in engine.module.parameters())
    shard_shapes = all(before["params"][n].shape == p.to_local().shape
                       for n, p in engine.module.named_parameters())

    want_p = naive_reference(model_dir, tokenizer, prompts, responses, p_oar, temperature)
    want_g = base.hf_reference(model_dir, tokenizer, prompts, responses, g_oar, 3)

    def err(out, want):
        return max(float((g.float() - w).abs().max()) for g, w in zip(out["oar_importance"].unbind(), want))

    print("RANK " + json.dumps({
        "rank": rank,
        "p_err": err(p_out, want_p), "p_scale": max(float(w.abs().max()) for w in want_p),
        "g_err": err(g_out, want_g), "g_scale": max(float(w.abs().max()) for w in want_g),
        "copies": p_out["oar_perturb_copies"].tolist(),
        "answers": [int(a.any()) for a in g_out["oar_answer_mask"].unbind()],
        "fsdp_modules": len(fsdp2_modules(engine.module)),
        "p_collectives": p_calls, "g_collectives": g_calls,
        "state_unchanged": base.same(before, after),
        "sharded_after": sharded and shard_shapes,
    }), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if "--rank" in sys.argv:
        run_rank(sys.argv[1], int(sys.argv[sys.argv.index("--rank") + 1]), sys.argv[sys.argv.index("--port") + 1])
    else:
        timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 240.0
        sys.exit(launch(sys.argv[1], timeout))
