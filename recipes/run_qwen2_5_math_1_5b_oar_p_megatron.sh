#!/usr/bin/env bash
# OAR-P (occlusion importance, chunk mode: at most 16 spans per response) | Qwen2.5-Math-1.5B | Megatron
# Where checked: never run on a GPU; composed and validated against verl's config on CPU in the tests. Hardware: 80 GB GPUs, 1 node x 8 by default (NNODES, GPUS_PER_NODE).
# Settings, hardware and memory assumptions: recipes/config/qwen2_5_math_1_5b_oar_p_megatron.yaml. Environment: recipes/launch.sh.
# Usage: bash recipes/run_qwen2_5_math_1_5b_oar_p_megatron.sh [hydra overrides...]
exec bash "$(dirname "$0")/launch.sh" qwen2_5_math_1_5b_oar_p_megatron "$@"
