"""Two data-parallel ranks (gloo, CPU) of verl's real FSDP2 engine scoring different data, so that their
numbers of model calls differ: OAR-P (chunk and hierarchical), OAR-G non-fused and fused into verl's
old-log-prob pass (noisy KL and log-likelihood), with the parameters sharded (the default: equal call
counts, ``engines.fsdp.lockstep``) and, opt-in, gathered once per pass (``algorithm.oar.gather_params``), on
an fp32 worker (packed rows) and a bf16 one (padded rows). Each rank's fp32 importance must equal a
one-process plain-transformers reference, the gathered passes' the sharded ones' bit for bit, the fused
log-probs verl's own ``compute_log_prob``. The workers keep verl's default gradient checkpointing, which OAR-G's
pass applies (its backward recomputes each sharded layer); a ``*_plain`` pass is the same pass with it switched
off (the layers' flag), to be compared bit for bit and all-gather for all-gather. Per pass it records the all-gathers, the model's forwards and the largest
parameter bytes unsharded at once (the storage of FSDP2's unsharded parameters, summed whenever a group
is unsharded), beside the same count in verl's own ``compute_log_prob`` forward. Prints one
``RANK {json}`` line per rank.

    VERL_PLATFORM=cpu python tests/engine/engine_multirank_check.py OUT_DIR [TIMEOUT]   # launcher: spawns 2 ranks
    python tests/engine/engine_multirank_check.py OUT_DIR 600 --cuda    # 2 GPUs, NCCL (prepared, not run here)
    (a rank: ... engine_multirank_check.py OUT_DIR --rank R --port P [--cuda])

``--cuda``: each rank on its own GPU (``cuda:RANK``) under verl's NVIDIA platform, NCCL; needs two GPUs (NCCL
refuses two ranks on one device). The references stay plain transformers on the CPU.
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
# answer (nothing to score: OAR-P and OAR-G make no call of their own), then a short response.
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


def launch(out_dir: str, timeout: float, cuda: bool = False) -> int:
    """Build the model, run both ranks, echo their output; exit code 0 iff both ranks exited 0."""
    os.environ.setdefault("VERL_PLATFORM", "nvidia" if cuda else "cpu")
    sys.path.insert(0, HERE)
    from engine_importance_check import build_model_dir

    build_model_dir(out_dir)
    port = str(_free_port())
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), out_dir, "--rank", str(r), "--port", port,
                          *(["--cuda"] if cuda else [])],
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


UNSHARDED = {"peak": 0, "group": {}, "groups": []}
"""The largest parameter storage unsharded at once (``peak``, reset per pass), each group's unsharded bytes
(``group``), and the FSDP2 groups of the engine being measured (``groups``); see :func:`_track_unsharded_bytes`."""


def _track_unsharded_bytes(module) -> dict:
    """Measure ``module``'s FSDP2 groups into :data:`UNSHARDED`: after every group's switch to its unsharded
    parameters (torch 2.13 ``FSDPParamGroup._to_unsharded``, after the all-gather copy-out), the bytes of all
    groups' unsharded parameter storage (``FSDPParam.all_gather_outputs``, freed on reshard) are summed."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from verl_oar.engines.fsdp.unshard import fsdp2_modules

    UNSHARDED.update(peak=0, group={})
    UNSHARDED["groups"] = [g for m in fsdp2_modules(module) for g in m._get_fsdp_state()._fsdp_param_groups]
    if getattr(FSDPParamGroup._to_unsharded, "measured", False):
        return UNSHARDED

    def nbytes(group) -> int:
        return sum(t.untyped_storage().nbytes() for p in group.fsdp_params for t in p.all_gather_outputs)

    original = FSDPParamGroup._to_unsharded

    def to_unsharded(self):
        original(self)
        UNSHARDED["group"][id(self)] = max(UNSHARDED["group"].get(id(self), 0), nbytes(self))
        UNSHARDED["peak"] = max(UNSHARDED["peak"], sum(nbytes(g) for g in UNSHARDED["groups"]))

    to_unsharded.measured = True
    FSDPParamGroup._to_unsharded = to_unsharded
    return UNSHARDED


def hierarchical_reference(model_dir, tokenizer, prompts, responses, oar: dict, temperature: float):
    """OAR-P hierarchical mode per sequence on plain transformers: ``core.perturbation.hierarchical_importance``
    with the naive whole-sequence forward per occluded span as its scorer."""
    import torch
    from _oar_p_reference import naive_perturbation_importance  # tests/ is on the path (engine_importance_check)
    from transformers import AutoModelForCausalLM

    from verl_oar.core.answer_span import locate_answer_tokens
    from verl_oar.core.config import OARConfig
    from verl_oar.core.perturbation import hierarchical_importance

    cfg = OARConfig(**oar)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    neutral = tokenizer.pad_token_id
    out = []
    for p, r in zip(prompts, responses):
        ids = torch.cat([p, r])
        reasoning = torch.zeros(len(ids), dtype=torch.bool)
        predict = torch.zeros(len(ids), dtype=torch.bool)
        located = locate_answer_tokens(r.tolist(), tokenizer)
        if located is not None:
            reasoning[len(p):] = torch.tensor(located[0])
            predict[torch.nonzero(torch.tensor(located[1])).flatten() + len(p) - 1] = True

        def score(spans, ids=ids, predict=predict):
            return [naive_perturbation_importance(lambda x: model(input_ids=x).logits, ids, spans[0], predict,
                                                  neutral, cfg.outcome, temperature)]

        importance, _ = hierarchical_importance(score, [reasoning], cfg.perturbation_config())
        out.append(importance[0][len(p):])
    return out


def run_rank(out_dir: str, rank: int, port: str, cuda: bool = False) -> None:
    os.environ.update(VERL_PLATFORM="nvidia" if cuda else "cpu", RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    sys.path.insert(0, HERE)
    import engine_importance_check as base
    import torch
    from engine_perturbation_check import naive_reference
    from torch.distributed.tensor import DTensor
    from transformers import AutoTokenizer
    from verl.utils import tensordict_utils as tu

    from verl_oar.core.hf import checkpointed_layers
    from verl_oar.engines.fsdp.unshard import fsdp2_modules

    model_dir = os.path.join(out_dir, "tiny_model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base.PROMPTS[:], base.RESPONSES[:] = RANK_DATA[rank]
    counts = _count_fsdp_collectives()
    temperature = 0.8
    noisy = {"objective": "noisy_kl", "saliency": "grad_x_input", "outcome": "mean"}
    loglik = {"objective": "loglik", "saliency": "grad_x_input", "outcome": "mean"}
    chunk = {"outcome": "mean", "perturb_mode": "chunk", "perturb_budget": 3}
    hier = {"outcome": "mean", "perturb_mode": "hierarchical", "perturb_budget": 3, "perturb_refine_top": 1,
            "perturb_refine_unit": 2}

    def on_worker(prefix: str, passes_to_run: dict, **settings) -> dict:
        """Build a worker, measure verl's own old-log-prob pass then each of ``passes_to_run``
        (name -> (oar config, method, fused)); returns what the launcher prints for this worker."""
        extra = (("trainer.device=cuda",) if cuda else ()) + tuple(settings.pop("extra", ()))
        worker = base.build_worker(model_dir, use_dynamic_bsz=settings.pop("use_dynamic_bsz", False), micro_bsz=1,
                                   param_offload=False, extra=extra, **settings)
        engine = worker.actor.engine
        layers = checkpointed_layers(engine.module)  # verl's default enable_gradient_checkpointing=true
        before = base.snapshot(engine)
        unsharded = _track_unsharded_bytes(engine.module)
        forwards, computed = [0], [0]
        engine.module.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        for layer in layers:  # the layers' attention runs once more per layer in a checkpointed backward
            layer.self_attn.register_forward_hook(lambda *_: computed.__setitem__(0, computed[0] + 1))
        passes: dict = {}

        def measured(name, call):
            counts.clear()
            forwards[0] = computed[0] = 0
            unsharded["peak"] = 0
            out = call()
            passes[name] = {"collectives": dict(counts), "forwards": forwards[0], "peak_bytes": unsharded["peak"],
                            "attention_calls": computed[0]}
            return out

        # verl's own old-log-prob pass: the forward level of unsharded parameters, and the fused passes' log-probs
        plain, _, _ = base.make_batch(tokenizer, {}, step=3)
        tu.assign_non_tensor(plain, temperature=1.0, calculate_entropy=True, compute_loss=False)
        verl_out = measured("verl_log_prob", lambda: worker.compute_log_prob(plain))
        whole = sum(unsharded["group"].values())  # every group was unsharded once in that forward

        outputs, results = {}, {}
        for name, (oar, method, fused) in passes_to_run.items():
            data, prompts, responses = base.make_batch(tokenizer, oar, step=3)
            # OAR-G's reference (engine_importance_check.hf_reference) samples at temperature 1
            tu.assign_non_tensor(data, oar_method=method, oar_config=oar, oar_step=3,
                                 temperature=temperature if method == "perturbation" else 1.0)
            if fused:
                tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False, oar_fused=True)
            run = worker.compute_log_prob if fused else worker.compute_token_importance
            plain = [layer for layer in layers if name.endswith("_plain")]  # checkpointing off for this pass
            for layer in plain:
                layer.gradient_checkpointing = False
            try:
                out = outputs[name] = measured(name, lambda run=run, data=data: run(data))
            finally:
                for layer in plain:
                    layer.gradient_checkpointing = True
            results[name] = {"answers": [int(a.any()) for a in out["oar_answer_mask"].unbind()]}
            if method == "perturbation":
                results[name]["copies"] = out["oar_perturb_copies"].tolist()
            if fused:
                results[name]["log_probs_identical"] = base.bitwise_equal(out["log_probs"], verl_out["log_probs"])
                results[name]["entropy_identical"] = base.bitwise_equal(out["entropy"], verl_out["entropy"])
            if settings.get("param_dtype", "fp32") == "fp32":  # plain-transformers reference, fp32
                if method == "perturbation":
                    reference = hierarchical_reference if oar["perturb_mode"] == "hierarchical" else naive_reference
                    want = reference(model_dir, tokenizer, prompts, responses, oar, temperature)
                else:
                    want = base.hf_reference(model_dir, tokenizer, prompts, responses, oar, 3)
                results[name]["err"] = max(float((g.float() - w).abs().max())
                                           for g, w in zip(out["oar_importance"].unbind(), want))
                results[name]["scale"] = max(float(w.abs().max()) for w in want)
        for name in passes_to_run:  # the gathered pass computes the same numbers from the same parameters
            if name.endswith("_gathered"):
                sharded = name[: -len("_gathered")]
                results[name]["identical_to_sharded"] = base.bitwise_equal(
                    outputs[name]["oar_importance"], outputs[sharded]["oar_importance"])
            if name.endswith("_plain"):  # and without gradient checkpointing
                results[name]["identical_to_checkpointed"] = base.bitwise_equal(
                    outputs[name]["oar_importance"], outputs[name[: -len("_plain")]]["oar_importance"])
        after = base.snapshot(engine)
        sharded_after = all(isinstance(p, DTensor) for p in engine.module.parameters()) and all(
            before["params"][n].shape == p.to_local().shape for n, p in engine.module.named_parameters())
        mesh = getattr(engine, "device_mesh", None)
        return {"results": {prefix + k: v for k, v in results.items()},
                "mesh": None if mesh is None else {"shape": list(mesh.shape), "names": list(mesh.mesh_dim_names or ())},
                "passes": {prefix + k: v for k, v in passes.items()},
                "whole_model_bytes": whole, "fsdp_modules": len(fsdp2_modules(engine.module)),
                "checkpointed_layers": len(layers),
                "state_unchanged": base.same(before, after), "sharded_after": sharded_after}

    fp32 = on_worker("", {
        "p_chunk": (chunk, "perturbation", False), "p_hier": (hier, "perturbation", False),
        "p_chunk_gathered": ({**chunk, "gather_params": True}, "perturbation", False),
        "g_noisy": (noisy, "gradient", False), "g_fused_noisy": (noisy, "gradient", True),
        "g_fused_loglik": (loglik, "gradient", True),
        "g_noisy_gathered": ({**noisy, "gather_params": True}, "gradient", False),
        "g_noisy_plain": (noisy, "gradient", False),
    }, use_remove_padding=True)
    # bf16 mixed precision as real runs, rows padded instead of packed: sharded vs gathered bit for bit
    bf16 = on_worker("bf16_", {
        "p_chunk": (chunk, "perturbation", False),
        "p_chunk_gathered": ({**chunk, "gather_params": True}, "perturbation", False),
        "g_fused_noisy": (noisy, "gradient", True),
        "g_fused_noisy_gathered": ({**noisy, "gather_params": True}, "gradient", True),
        "g_fused_noisy_plain": (noisy, "gradient", True),
    }, use_remove_padding=False, param_dtype="bf16")
    # HSDP (fsdp_size=1: each rank a replica of the whole model, 2 replicas) with dynamic batch size, fp32 packed rows:
    # the combination a GPU cluster runs with several nodes, checked here on gloo
    hsdp = on_worker("hsdp_", {
        "p_chunk": (chunk, "perturbation", False),
        "g_noisy": (noisy, "gradient", False), "g_fused_noisy": (noisy, "gradient", True),
    }, use_remove_padding=True, use_dynamic_bsz=True, max_token_len=1024,
        extra=("actor_rollout_ref.actor.fsdp_config.fsdp_size=1",))
    print("RANK " + json.dumps({"rank": rank, "fp32": fp32, "bf16": bf16, "hsdp": hsdp}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    on_cuda = "--cuda" in sys.argv
    if "--rank" in sys.argv:
        run_rank(sys.argv[1], int(sys.argv[sys.argv.index("--rank") + 1]), sys.argv[sys.argv.index("--port") + 1],
                 on_cuda)
    else:
        positional = [a for a in sys.argv[1:] if not a.startswith("--")]
        timeout = float(positional[1]) if len(positional) > 1 else 240.0
        sys.exit(launch(positional[0], timeout, on_cuda))
