#!/usr/bin/env bash
# Measure collectives with nccl on one or more GPU nodes, the same code as on a laptop.
#
# On every node (NODE_RANK = 0 .. NNODES-1, MASTER_ADDR = the first node's address):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 GPUS_PER_NODE=8 validate/recipes/torchrun_bench.sh
# collsim detects torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment), joins through
# env://, binds each rank to cuda:LOCAL_RANK and times with cuda.synchronize(); rank 0 prints
# the nccl-tests-style table and writes the CSV with its metadata (ranks per node, nodes,
# torch version, host, date). Then, on any machine:
#   collsim validate calibrate $OUT --base dgx_h100 -o topologies/my_cluster.yaml
#   collsim validate compare $OUT --topology topologies/my_cluster.yaml
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29511}
OUT=${OUT:-validate/data/nccl_${NNODES}x${GPUS_PER_NODE}_$(date +%Y%m%d_%H%M).csv}
COLLSIM=$(command -v collsim)

torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    "$COLLSIM" validate bench --backend nccl \
    --ops all_reduce,all_gather,reduce_scatter,broadcast,all_to_all,send_recv \
    -b 8 -e 8G -f 2 --iters 20 --warmup 5 --rounds 2 --timeout 1800 -o "$OUT"
