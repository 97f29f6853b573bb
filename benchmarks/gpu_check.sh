#!/usr/bin/env bash
# The checks a run on a CUDA machine owes the compiled path, as one script with a time
# limit per section, so that a short device lease covers it:
#   1. the CUDA tests: compiled steps decode the fixed-shape steps' images (AR, naive,
#      cascade+lantern, one image and a batch), the device walk, the engine's draws on
#      CUDA, the host-device waits a step;
#   2. benchmarks/gpu.py: AR eager and compiled at the demo, GPT-B and GPT-XL shapes (with
#      compile times), the verify curve, naive and cascade+lantern on the demo at a fixed
#      tree and on auto trees, the oracle (its JSON into the output folder);
#   3. (full mode) benchmarks/relax_overhead.py on CUDA: each stack's relaxation eager and
#      compiled, against a compiled GPT-B verify.
# Modes: --first-run (the default: sections 1 and 2 with gpu.py --first-run, under 8
# minutes on one H100) or --full (gpu.py --quick with its batch tables and the demo's
# bench, and section 3: about 12 minutes).  Every section runs even after one fails; the
# script exits non-zero if any section failed or ran out of time, naming them.
#
#   bash benchmarks/gpu_check.sh [--first-run | --full] [output folder, default ./gpu-check]
set -u
mode=first-run
case "${1:-}" in --first-run|--full) mode=${1#--}; shift ;; esac
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
python -c "import specimg" 2>/dev/null || pip install --quiet --no-deps --no-build-isolation -e .  # a machine with torch but no specimg
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$out/inductor-cache}"  # compiled programs kept on disk: a rerun compiles less

failed=()
section() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || failed+=("$name (exit $rc$([ "$rc" -eq 124 ] && echo ', out of time'))")
}

section cuda-tests 120 python -m pytest -q -rs tests/test_fixed_step.py tests/test_device_walk.py tests/test_draws.py
if [ "$mode" = first-run ]; then
    section gpu 330 python benchmarks/gpu.py --first-run --out "$out/gpu.json"
else
    section gpu 480 python benchmarks/gpu.py --quick --out "$out/gpu.json"
    section relax-overhead 120 python benchmarks/relax_overhead.py --device cuda --repeats 5
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: failed: ${failed[*]}"
    exit 1
fi
echo "gpu_check: every section passed; the table is in $out/gpu.json"
