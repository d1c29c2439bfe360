#!/usr/bin/env bash
# OPPO, teacher-oracle (Qwen2.5-Math-7B-Instruct, frozen, scores the evidence; two teacher passes) | Qwen2.5-Math-1.5B | FSDP2
# Where checked: never run on a GPU; a shrunk CPU copy trains through this script in the tests. Hardware: 80 GB GPUs, 1 node x 8 by default (NNODES, GPUS_PER_NODE).
# Settings, hardware and memory assumptions: recipes/config/qwen2_5_math_1_5b_oppo_teacher.yaml. Environment: recipes/launch.sh.
# Usage: bash recipes/run_qwen2_5_math_1_5b_oppo_teacher.sh [hydra overrides...]
exec bash "$(dirname "$0")/launch.sh" qwen2_5_math_1_5b_oppo_teacher "$@"
