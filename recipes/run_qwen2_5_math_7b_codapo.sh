#!/usr/bin/env bash
# CoDaPO (question value from confidence and difficulty x GRPO; every batch used twice, CoDaSampling) | Qwen2.5-Math-7B | FSDP2
# Where checked: never run on a GPU; composed and validated against verl's config on CPU in the tests. Hardware: 80 GB GPUs, 1 node x 8 by default (NNODES, GPUS_PER_NODE).
# Settings, hardware and memory assumptions: recipes/config/qwen2_5_math_7b_codapo.yaml. Environment: recipes/launch.sh.
# Usage: bash recipes/run_qwen2_5_math_7b_codapo.sh [hydra overrides...]
exec bash "$(dirname "$0")/launch.sh" qwen2_5_math_7b_codapo "$@"
