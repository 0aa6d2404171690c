#!/usr/bin/env bash
# Time the kernel grid of `collsim validate compute` on one NVIDIA GPU and compare it with the
# catalogue device's compute model, on a machine that has Python and torch but no collsim, no
# simpy and no network. Run from the repository root (see validate/README.md, "One GPU"):
#
#   OUT=/some/folder bash validate/recipes/gpu_compute.sh
#
# Writes, under $OUT, as it goes (each file is complete or rewritten whole after each step;
# the full profile after each of its sections, so a run that is stopped keeps what it measured):
#   gpu_compute.log            everything printed
#   nvidia_smi.csv             the GPU, its memory, clocks and power limit
#   ${KEY}_profile_quick.yaml  the quick grid (seconds): something to compare even if the
#                              full grid does not finish
#   ${KEY}_profile.yaml        the full grid (about a minute on an H200: see the README)
#   ${KEY}_kernels.csv         every measured kernel vs the model of catalogue device $KEY
#   ${KEY}_kernels_quick.csv   the same for the quick profile
# (the per-kind summaries, median and worst measured/model ratio, are in the log)
#
# Environment: OUT (required), KEY (catalogue device to compare with, default h200), WHEELS
# (folder of carried wheels, default .whl), PYTHON (default python3), TORCH_DEVICE (default
# cuda; cpu for a dry run of the plumbing), QUICK_TIMEOUT_S (90), FULL_TIMEOUT_S (270).
set -uo pipefail
: "${OUT:?set OUT to the folder the results go to}"
KEY=${KEY:-h200}
WHEELS=${WHEELS:-.whl}
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
TORCH_DEVICE=${TORCH_DEVICE:-cuda}
QUICK_TIMEOUT_S=${QUICK_TIMEOUT_S:-90}
FULL_TIMEOUT_S=${FULL_TIMEOUT_S:-270}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_compute.log") 2>&1
export PYTHONUNBUFFERED=1
echo "# gpu_compute.sh $(date -u +%FT%TZ) in $PWD, $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"
echo "# python $PYTHON: $("$PYTHON" -V 2>&1)"

# 1. The GPU, as the driver and torch see it.
if [ "$TORCH_DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.sm,power.limit \
        --format=csv > "$OUT/nvidia_smi.csv" && cat "$OUT/nvidia_smi.csv" \
        || echo "# nvidia-smi failed (rc $?)"
fi
"$PYTHON" - "$TORCH_DEVICE" <<'EOF' || { echo "# torch check failed: stopping"; exit 3; }
import sys
import torch
print(f"# torch {torch.__version__}, cuda {torch.version.cuda}, cudnn "
      f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}")
if sys.argv[1] == "cuda":
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    p = torch.cuda.get_device_properties(0)
    print(f"# {p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, "
          f"capability {p.major}.{p.minor}")
    from torch.nn.attention import SDPBackend
    print("# SDPA backends:", ", ".join(b.name for b in SDPBackend))
EOF

# 2. What collsim imports: the repo copy on PYTHONPATH, and each missing pure-Python
#    dependency from the carried wheels (pip when it works, else the wheel itself on the path:
#    a pure-Python wheel is importable as a zip; PyYAML then runs without its C extension).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
shopt -s nocaseglob  # PyYAML-6.0.1-... or pyyaml-6.0.4-...
for pair in yaml:pyyaml click:click simpy:simpy numpy:numpy; do
    mod=${pair%%:*}
    dist=${pair##*:}
    "$PYTHON" -c "import $mod" 2>/dev/null && continue
    wheel=$(ls "$WHEELS"/"$dist"-*.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ]; then
        echo "# $mod missing and no $WHEELS/$dist-*.whl carried"
        continue
    fi
    if "$PYTHON" -m pip install --no-index --no-deps --find-links "$WHEELS" "$dist" -q \
        > "$OUT/pip_$dist.txt" 2>&1; then
        echo "# installed $dist from $WHEELS"
        rm -f "$OUT/pip_$dist.txt"
    else
        echo "# pip could not install $dist ($(tail -1 "$OUT/pip_$dist.txt")): wheel on PYTHONPATH"
        rm -f "$OUT/pip_$dist.txt"
        for w in "$WHEELS"/"$dist"-*py3-none-any.whl "$WHEELS"/"$dist"-*.whl; do
            [ -f "$w" ] || continue
            case "$w" in /*) ;; *) w="$PWD/$w" ;; esac
            export PYTHONPATH="$PYTHONPATH:$w"
            break
        done
    fi
done
COLLSIM=("$PYTHON" -c 'from collsim.cli import main; main()')
"${COLLSIM[@]}" --version || { echo "# collsim does not import: stopping"; exit 4; }

# 3. The quick grid, then the full one; each under a wall-clock limit.
timeout -k 10 "$QUICK_TIMEOUT_S" \
    "${COLLSIM[@]}" validate compute --device "$TORCH_DEVICE" --quick -o "$OUT/${KEY}_profile_quick.yaml"
echo "# quick grid: rc $?"
timeout -k 10 "$FULL_TIMEOUT_S" \
    "${COLLSIM[@]}" validate compute --device "$TORCH_DEVICE" -o "$OUT/${KEY}_profile.yaml"
full_rc=$?
echo "# full grid: rc $full_rc (124: stopped at ${FULL_TIMEOUT_S} s; the sections written are kept)"

# 4. Measured vs modelled, from whichever profiles exist.
for name in "${KEY}_profile" "${KEY}_profile_quick"; do
    [ -f "$OUT/$name.yaml" ] || continue
    tag=${name/_profile/_kernels}
    timeout -k 10 120 "${COLLSIM[@]}" validate kernels "$OUT/$name.yaml" --device "$KEY" \
        --summary -o "$OUT/$tag.csv"
    echo "# $tag: rc $?"
done
echo "# done $(date -u +%FT%TZ); full grid rc $full_rc"
exit "$full_rc"
