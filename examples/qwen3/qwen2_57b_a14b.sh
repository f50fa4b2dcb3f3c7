#!/usr/bin/env bash
# qwen2_57b_a14b on 32 GPUs (4 nodes x 8): TP=2 (+SP), CP=4, PP=4, EP=8, ring dispatcher (configs/qwen2_57b_a14b.yaml).
# Run once per node with NODE_RANK/MASTER_ADDR set, or: sbatch examples/qwen3/slurm.sbatch qwen2_57b_a14b
exec "$(dirname "${BASH_SOURCE[0]}")/train.sh" qwen2_57b_a14b "$@"
