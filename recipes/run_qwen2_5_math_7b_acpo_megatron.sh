#!/usr/bin/env bash
# ACPO (advantages reweighted per token by a surrogate entropy, asymmetric by outcome; no extra pass) | Qwen2.5-Math-7B | Megatron
# Where checked: never run on a GPU; composed and validated against verl's config on CPU in the tests. Hardware: 80 GB GPUs, 1 node x 8 by default (NNODES, GPUS_PER_NODE).
# Settings, hardware and memory assumptions: recipes/config/qwen2_5_math_7b_acpo_megatron.yaml. Environment: recipes/launch.sh.
# Usage: bash recipes/run_qwen2_5_math_7b_acpo_megatron.sh [hydra overrides...]
exec bash "$(dirname "$0")/launch.sh" qwen2_5_math_7b_acpo_megatron "$@"
