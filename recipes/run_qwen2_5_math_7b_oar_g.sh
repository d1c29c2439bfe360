#!/usr/bin/env bash
# OAR-G (input-gradient importance, fused into the old-log-prob pass) | Qwen2.5-Math-7B | FSDP2
# Settings, hardware and memory assumptions: recipes/config/qwen2_5_math_7b_oar_g.yaml. Environment: recipes/launch.sh.
# Usage: bash recipes/run_qwen2_5_math_7b_oar_g.sh [hydra overrides...]
exec bash "$(dirname "$0")/launch.sh" qwen2_5_math_7b_oar_g "$@"
