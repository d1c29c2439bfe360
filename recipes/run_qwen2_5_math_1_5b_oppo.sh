#!/usr/bin/env bash
# OPPO, self-oracle (value recursion over the evidence of the reference answer; one extra pass) | Qwen2.5-Math-1.5B | FSDP2
# Where checked: never run on a GPU; a shrunk CPU copy trains through this script in the tests. Hardware: 80 GB GPUs, 1 node x 8 by default (NNODES, GPUS_PER_NODE).
# Settings, hardware and memory assumptions: recipes/config/qwen2_5_math_1_5b_oppo.yaml. Environment: recipes/launch.sh.
# Usage: bash recipes/run_qwen2_5_math_1_5b_oppo.sh [hydra overrides...]
exec bash "$(dirname "$0")/launch.sh" qwen2_5_math_1_5b_oppo "$@"
