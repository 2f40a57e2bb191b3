#!/usr/bin/env bash
# The DDP acceptance of docs/gpu.md (called by tests/gpu/run.sh on a GPU machine with torch 2.x
# and the collserve package on PYTHONPATH): 20 SGD steps of an MLP under DistributedDataParallel,
#   1. one rank on cuda:0 under backend "collserve" against backend "nccl";
#   2. four ranks sharing cuda:0 under "collserve" against four CPU ranks under "gloo";
#   3. one rank under "collserve" with COLLSERVE_CUDA_PATH=nccl (NCCL in the rank) against "nccl";
# each compared within 1e-5 relative (bench/gpu/ddp_compare.py --compare). Exit 1 on a mismatch.
set -uo pipefail
out=${1:?usage: ddp_run.sh OUT_DIR}
here=$(dirname "$0")
status=0
py() { timeout -k 10 240 python3 "$here/ddp_compare.py" "$@" || status=1; }
py --backend collserve --ranks 1 --out "$out/ddp_cs1.pt"
py --backend nccl --ranks 1 --out "$out/ddp_nccl1.pt"
py --compare "$out/ddp_cs1.pt" "$out/ddp_nccl1.pt" --rtol 1e-5
# 3. one rank running NCCL itself (COLLSERVE_CUDA_PATH=nccl: one GPU per rank) against "nccl".
COLLSERVE_CUDA_PATH=nccl py --backend collserve --ranks 1 --out "$out/ddp_cs1_rank_nccl.pt"
py --compare "$out/ddp_cs1_rank_nccl.pt" "$out/ddp_nccl1.pt" --rtol 1e-5
py --backend collserve --ranks 4 --out "$out/ddp_cs4.pt"
py --backend gloo --ranks 4 --device cpu --out "$out/ddp_gloo4.pt"
py --compare "$out/ddp_cs4.pt" "$out/ddp_gloo4.pt" --rtol 1e-5
exit $status
