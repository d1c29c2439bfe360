#!/usr/bin/env bash
# ACPO (advantages reweighted per token by a surrogate entropy, asymmetric by outcome; no extra pass) | Qwen2.5-Math-7B | Megatron
# Settings, hardware and memory assumptions: recipes/config/qwen2_5_math_7b_acpo_megatron.yaml. Environment: recipes/launch.sh.
# Usage: bash recipes/run_qwen2_5_math_7b_acpo_megatron.sh [hydra overrides...]
exec bash "$(dirname "$0")/launch.sh" qwen2_5_math_7b_acpo_megatron "$@"
