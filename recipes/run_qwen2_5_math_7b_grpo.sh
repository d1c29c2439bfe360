#!/usr/bin/env bash
# GRPO baseline | Qwen2.5-Math-7B | FSDP2
# Where checked: never run on a GPU; composed and validated on CPU; the method recipes differ from it only in algorithm.*. Hardware: 80 GB GPUs, 1 node x 8 by default (NNODES, GPUS_PER_NODE).
# Settings, hardware and memory assumptions: recipes/config/qwen2_5_math_7b_grpo.yaml. Environment: recipes/launch.sh.
# Usage: bash recipes/run_qwen2_5_math_7b_grpo.sh [hydra overrides...]
exec bash "$(dirname "$0")/launch.sh" qwen2_5_math_7b_grpo "$@"
