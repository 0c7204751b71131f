#!/usr/bin/env bash
#SBATCH --job-name=llama-pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=logs/slurm-%j.out
#SBATCH --requeue
#SBATCH --signal=USR1@180
#
# Multi-node Llama 3, Mixtral, Qwen3-MoE or DeepSeek-V3 training under Slurm: one torchrun per node, rendezvous
# from Slurm's environment.
#
#   sbatch --nodes 4 examples/llama/train_llama_slurm.sh <MODEL_SIZE> <MBS> <BS_PER_NODE> <SEQ> <ITERS> <FSDP> <RECOMPUTE>
#   e.g. sbatch --nodes 4 examples/llama/train_llama_slurm.sh 70 1 16 8192 20 0 1
#        MODEL=mixtral EP=8 sbatch --nodes 2 examples/llama/train_llama_slurm.sh 8x7B 1 32 4096 20 0 0
#
#   MODEL   llama3 | mixtral | qwen3_moe | deepseek_v3: the launch script each node runs,
#           train_llama3.sh, examples/mixtral/train_mixtral.sh, examples/qwen3_moe/train_qwen3_moe.sh
#           or examples/deepseek_v3/train_deepseek_v3.sh                                  [llama3]
#           (MODEL_SIZE is then that script's: 8 | 70, 8x7B | 8x22B, 30B-A3B, proxy | 671B;
#           FSDP must be 0 with experts)
# Other knobs (TP, PP, VPP, EP, ETP, DATA_PATH, TOKENIZER_MODEL, LLAMA_VERSION, MOE_DISPATCHER,
# GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, LOG_DIR, ...) pass through the environment to that script
# (see its header).
# The global batch is BS_PER_NODE x number of nodes. The first node of the allocation hosts the
# rendezvous (MASTER_ADDR); every node starts torchrun for its GPUs.
#
# Checkpoints and requeueing: the run saves to CKPT_DIR [checkpoints/<llama|mixtral|qwen3_moe><MODEL_SIZE>-<job name>]
# every SAVE_INTERVAL iterations [500] and always resumes from the latest checkpoint there. 180 s
# before the time limit Slurm sends SIGUSR1 (--signal above): the workers finish the iteration,
# save and exit; if training is not finished and made progress, the job requeues itself
# (REQUEUE=0 turns that off) and the next start continues where it stopped.
set -euo pipefail
if [ $# -ne 7 ]; then
  echo "usage: sbatch [--nodes N] $0 MODEL_SIZE MBS BS_PER_NODE SEQ ITERS FSDP RECOMPUTE" >&2
  exit 2
fi
: "${SLURM_JOB_NODELIST:?run this under sbatch (SLURM_JOB_NODELIST is not set)}"
ROOT=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
MODEL=${MODEL:-llama3}
case "$MODEL" in
  llama3)    SCRIPT=examples/llama/train_llama3.sh ; NAME=llama ;;
  mixtral)   SCRIPT=examples/mixtral/train_mixtral.sh ; NAME=mixtral ;;
  qwen3_moe) SCRIPT=examples/qwen3_moe/train_qwen3_moe.sh ; NAME=qwen3_moe ;;
  deepseek_v3) SCRIPT=examples/deepseek_v3/train_deepseek_v3.sh ; NAME=deepseek_v3 ;;
  *) echo "MODEL must be llama3, mixtral, qwen3_moe or deepseek_v3 (got '$MODEL')" >&2; exit 2 ;;
esac
NODES=${SLURM_JOB_NUM_NODES:-1}
export MODEL_SIZE=$1 MBS=$2 BS=$(($3 * NODES)) SEQ_LENGTH=$4 TOTAL_ITERS=$5 FSDP=$6 RECOMPUTE=$7
export NNODES=$NODES
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-29500}
export CKPT_DIR=${CKPT_DIR:-$ROOT/checkpoints/${NAME}${MODEL_SIZE}-${SLURM_JOB_NAME:-job}}
export SAVE_INTERVAL=${SAVE_INTERVAL:-500}
TRACKER="$CKPT_DIR/latest_checkpointed_iteration.txt"
saved_iteration() { cat "$TRACKER" 2>/dev/null || echo 0; }
START_ITERATION=$(saved_iteration)
export LOG_DIR=${LOG_DIR:-$ROOT/logs}
mkdir -p "$LOG_DIR"
# One task per node; each computes its NODE_RANK from Slurm and starts torchrun for its GPUs. The
# task ignores SIGUSR1 (so that it outlives the signal while torchrun forwards it to the workers).
status=0
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  bash -c "trap '' USR1; NODE_RANK=\$SLURM_NODEID exec bash '$ROOT/$SCRIPT'" || status=$?
END_ITERATION=$(saved_iteration)
if [ "${REQUEUE:-1}" = 1 ] && [ "$END_ITERATION" -lt "$TOTAL_ITERS" ] && [ "$END_ITERATION" -gt "$START_ITERATION" ]; then
  echo "stopped at iteration $END_ITERATION of $TOTAL_ITERS (exit status $status): requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
