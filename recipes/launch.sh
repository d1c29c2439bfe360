#!/usr/bin/env bash
# Launch one recipe of recipes/config with verl's own trainer:
#
#   bash recipes/launch.sh <recipe> [hydra overrides...]      e.g. qwen2_5_math_7b_oar_g
#
# which runs
#
#   python3 -m verl.trainer.main_ppo --config-path=<absolute path of recipes/config> --config-name=<recipe> \
#       data.train_files=$DATA_DIR/train.parquet data.val_files=[...] \
#       trainer.nnodes=$NNODES trainer.n_gpus_per_node=$GPUS_PER_NODE [overrides...]
#
# Environment (all optional):
#   DATA_DIR       where `python -m verl_oar.data.prepare_math --out DIR` wrote the parquet files
#                  (default $HOME/data/verl_oar_math)
#   MODEL_PATH     a local checkpoint instead of the recipe's hub name
#   NNODES, GPUS_PER_NODE   the cluster (default 1 x 8); train_batch_size stays the recipe's
#   RAY_ADDRESS    a running Ray cluster's dashboard, e.g. http://10.0.0.1:8265: submit with
#                  `ray job submit` instead of running here (multi-node, see docs/recipes/README.md)
#   RUNTIME_ENV_JSON  with RAY_ADDRESS: the job's runtime environment (`ray job submit --runtime-env-json`),
#                  e.g. '{"env_vars": {"HF_HOME": "/shared/hf"}}': what the driver and every worker must see
#   SUBMISSION_ID  with RAY_ADDRESS: the job's id (`ray job submit --submission-id`; default: one Ray makes)
#   PYTHON         the interpreter (default python3)
# Later overrides win: anything the recipe or this script sets can be overridden on the command line.
set -euo pipefail
recipe=${1:?usage: bash recipes/launch.sh <recipe> [hydra overrides...]; recipes: $(cd "$(dirname "$0")/config" && ls qwen*.yaml | sed 's/\.yaml$//' | tr '\n' ' ')}
shift
config_dir=$(cd "$(dirname "$0")/config" && pwd)
if [ ! -f "$config_dir/$recipe.yaml" ]; then
  echo "recipes/launch.sh: no recipe '$recipe' in $config_dir; recipes: $(cd "$config_dir" && ls qwen*.yaml | sed 's/\.yaml$//' | tr '\n' ' ')" >&2
  exit 2
fi
DATA_DIR=${DATA_DIR:-$HOME/data/verl_oar_math}
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PYTHON=${PYTHON:-python3}
val="['$DATA_DIR/math500.parquet','$DATA_DIR/aime24.parquet','$DATA_DIR/amc23.parquet','$DATA_DIR/minerva.parquet','$DATA_DIR/gsm8k_test.parquet']"
args=(
  -m verl.trainer.main_ppo
  --config-path="$config_dir"
  --config-name="$recipe"
  data.train_files="$DATA_DIR/train.parquet"
  data.val_files="$val"
  trainer.nnodes="$NNODES"
  trainer.n_gpus_per_node="$GPUS_PER_NODE"
)
if [ -n "${MODEL_PATH:-}" ]; then
  args+=(actor_rollout_ref.model.path="$MODEL_PATH")
fi
args+=("$@")
if [ -n "${RAY_ADDRESS:-}" ]; then
  # the job's driver runs on the head node: the recipe folder and DATA_DIR must exist there, and
  # verl + verl-oar must be installed on every node (the plugin loads through verl's entry point)
  submit=(ray job submit --address="$RAY_ADDRESS" --no-wait)
  if [ -n "${RUNTIME_ENV_JSON:-}" ]; then
    submit+=(--runtime-env-json="$RUNTIME_ENV_JSON")
  fi
  if [ -n "${SUBMISSION_ID:-}" ]; then
    submit+=(--submission-id="$SUBMISSION_ID")
  fi
  exec "${submit[@]}" -- "$PYTHON" "${args[@]}"
fi
exec "$PYTHON" "${args[@]}"
