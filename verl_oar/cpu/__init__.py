"""CPU mode: run verl's real trainer (Ray, FSDP2 engine, v1 trainer) on a machine without a GPU.

Opt-in only, with ``VERL_PLATFORM=cpu``; meant for laptops and CI, not for speed. The pieces:

- ``platform``: the verl platform named "cpu" (device "cpu", gloo) and the FSDP engines for it;
- ``verl_patches``: the few monkeypatches of verl it needs, each checked against verl 0.9.x;
- ``megatron_patches``: megatron-core 0.16's five CUDA assumptions routed to the CPU, so that a local-spec
  ``GPTModel`` runs here (the tests of the Megatron path; ``apply_megatron_patches()``, never automatic);
- ``megatron_llama``: a Hugging Face Llama checkpoint as that ``GPTModel`` (local spec) at any TP size;
- ``patch``: the one record both kinds of patch are (target, why, idempotent apply, the library's public fix);
- ``hf_rollout``: an "hf" rollout backend (transformers ``generate``) for the agent-loop machinery;
- ``workspace``: a tiny Qwen2, its tokenizer, arithmetic data and a reward function, built offline;
- ``overrides`` and ``launch``: the Hydra overrides for a CPU run and a launcher for
  ``python -m verl.trainer.main_ppo``.

Importing this package has no side effects; ``platform.register_cpu_platform()`` does the work.
"""
