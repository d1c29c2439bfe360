#!/usr/bin/env bash
# CSCR (credit taken from tokens the privileged prompts move most; self-teacher, both conditions in one extra pass) | Qwen2.5-Math-1.5B | Megatron
# Settings, hardware and memory assumptions: recipes/config/qwen2_5_math_1_5b_cscr_megatron.yaml. Environment: recipes/launch.sh.
# Usage: bash recipes/run_qwen2_5_math_1_5b_cscr_megatron.sh [hydra overrides...]
exec bash "$(dirname "$0")/launch.sh" qwen2_5_math_1_5b_cscr_megatron "$@"
