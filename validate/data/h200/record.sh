#!/bin/bash
# How this folder's files were recorded on one H200, from the repository root, in one go:
# the device profile of `collsim validate compute --device cuda` (full grid), 60 s of 8192^3 bf16
# GEMMs (20 s each taking all, 3/4 and half the time, the rest memory-bound adds) with the clocks
# and power NVML reads (validate/probes/gpu_sustained_clock.py), then
# validate/probes/gpu_step_trace.py (timed and traced single-GPU steps of two GPT sizes).
# OUT: the folder to write into. Each part has its own time limit and writes as it goes, so a
# part that fails or runs out of time keeps what the ones before it wrote.
# Where collsim is not installed: `PYTHONPATH=$PWD` (simpy is the one dependency a CUDA
# image with PyTorch, pandas and matplotlib may lack).
set -u
OUT=${OUT:?set OUT}
collsim(){ python3 -c 'import sys; from collsim.cli import main; sys.argv[0] = "collsim"; main()' "$@"; }
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } > "$OUT/nvidia_smi.txt" 2>&1
timeout 240 bash -c "$(declare -f collsim); collsim validate compute --device cuda -o '$OUT/h200_profile.yaml'" > "$OUT/compute.txt" 2>&1
echo "compute rc=$?" >> "$OUT/compute.txt"
timeout 90 python3 validate/probes/gpu_sustained_clock.py --seconds 20 --duties 1,0.75,0.5 -o "$OUT/clock.csv" >> "$OUT/nvidia_smi.txt" 2>&1
echo "clock rc=$?" >> "$OUT/nvidia_smi.txt"
timeout 150 python3 validate/probes/gpu_step_trace.py --out "$OUT" > "$OUT/step.txt" 2>&1
echo "step rc=$?" >> "$OUT/step.txt"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >> "$OUT/nvidia_smi.txt" 2>&1
