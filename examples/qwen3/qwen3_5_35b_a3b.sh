#!/usr/bin/env bash
# qwen3_5_35b_a3b on 32 GPUs (4 nodes x 8): TP=2 (+SP), CP=4, PP=4, EP=8, ring dispatcher (configs/qwen3_5_35b_a3b.yaml).
# Run once per node with NODE_RANK/MASTER_ADDR set, or: sbatch examples/qwen3/slurm.sbatch qwen3_5_35b_a3b
exec "$(dirname "${BASH_SOURCE[0]}")/train.sh" qwen3_5_35b_a3b "$@"
