"""From verl's sharded FSDP checkpoint to the heatmap: two CPU ranks (gloo) shard a tiny Qwen2 with FSDP2 and save it
with verl's own ``FSDPCheckpointManager`` (the actor's ``global_step_N/actor`` layout: ``model_world_size_2_rank_*.pt``,
``fsdp_config.json``, ``huggingface/``), ``python -m verl.model_merger merge --backend fsdp`` turns it into a Hugging
Face folder, and ``python -m verl_oar.tools.heatmap --model <that folder>`` scores it.

One process imports verl once, forks the two ranks (they inherit its imports) and, once they have saved, runs
``python -m verl.model_merger`` in itself (``runpy``, as ``-m`` does); as three processes each importing verl it took
about 75 s on 2 shared cores. Marked ``slow``. verl 0.9.1's merger casts every shard to bfloat16, so the merged weights are the saved ones
rounded to bfloat16 (checked exactly)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from _tiny_models import byte_qwen2

SAVE = textwrap.dedent('''
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def worker(rank, world, model_dir, out, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        manager = FSDPCheckpointManager(model, processing_class=AutoTokenizer.from_pretrained(model_dir),
                                        checkpoint_config={"save_contents": ["model"], "load_contents": ["model"]})
        manager.save_checkpoint(out, global_step=1)
        dist.destroy_process_group()

    if __name__ == "__main__":
        import runpy

        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (imported once, before the fork)
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager  # noqa: F401

        model_dir, out, port, merged = sys.argv[1:5]
        mp.start_processes(worker, args=(2, model_dir, out, port), nprocs=2, start_method="fork")
        print("SAVED", flush=True)
        sys.argv = ["verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", out, "--target_dir", merged]
        runpy.run_module("verl.model_merger", run_name="__main__", alter_sys=True)  # python -m verl.model_merger
''')


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.slow
def test_verl_fsdp_checkpoint_merged_by_verls_merger_loads_in_the_heatmap(tmp_path):
    from transformers import AutoModelForCausalLM

    from verl_oar.cpu.workspace import save_model_dir
    from verl_oar.tools.heatmap import main

    model, tokenizer = byte_qwen2(2)
    save_model_dir(model, tokenizer, tmp_path / "model")
    actor = tmp_path / "ckpt" / "global_step_1" / "actor"
    (tmp_path / "save.py").write_text(SAVE)
    done = subprocess.run([sys.executable, str(tmp_path / "save.py"), str(tmp_path / "model"), str(actor), _free_port(),
                           str(tmp_path / "hf")], capture_output=True, text=True, timeout=600)
    assert "SAVED" in done.stdout, done.stderr[-3000:]  # the two ranks saved
    assert sorted(p.name for p in actor.iterdir()) == ["fsdp_config.json", "huggingface", "model_world_size_2_rank_0.pt",
                                                       "model_world_size_2_rank_1.pt"]
    assert done.returncode == 0, done.stderr[-3000:]  # the merger
    original = model.state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    assert set(loaded) == set(original)
    for key, value in original.items():  # the merger's bfloat16, exactly
        assert torch.equal(loaded[key], value.bfloat16().float()), key

    # the heatmap reads the merged folder (its tokenizer too) and scores it as the same weights saved directly; saved
    # in bfloat16 like the merger's, so that both load through the same upcast (an fp32 file of equal values loads
    # into other memory, and OAR-P's differences of near-equal log-probs then differ in the last bits, ~1e-9)
    rounded, _ = byte_qwen2(2)
    save_model_dir(rounded.bfloat16(), tokenizer, tmp_path / "rounded")
    args = ["--prompt", "max: 3 7 | 2 5", "--response", "qzt kdm 7 abx \\boxed{7}", "--estimators", "oar_p,acpo",
            "--device", "cpu"]
    from_checkpoint = main(["--model", str(tmp_path / "hf"), "--out", str(tmp_path / "a"), *args])
    direct = main(["--model", str(tmp_path / "rounded"), "--out", str(tmp_path / "b"), *args])
    assert from_checkpoint["rows"][0]["scores"] == direct["rows"][0]["scores"]
    assert from_checkpoint["rows"][0]["response_ids"] == direct["rows"][0]["response_ids"]
