#!/usr/bin/env bash
# The checks a first run on a CUDA machine owes the graph path, as one script with a time
# limit per section (about 10 minutes in all), so that a short device lease covers it:
#   1. the CUDA tests: graphs replay the static forwards exactly, graphed naive is graphed
#      AR, the replayed growth (one image's tree, a batch's forest), relaxation, walk and
#      forward-with-distributions (AR's step, a tree's score) decode the eager programs'
#      tokens, a batch's graphs (verify, AR step, commit) decode its static steps' images
#      while capturing and replaying, the engine's draw is torch.multinomial's on CUDA,
#      the host-device waits a step;
#   2. benchmarks/gpu.py --quick: AR eager and graphed, the verify curve, batches, the
#      fixed-tree runs, the oracle and the demo's default bench (its JSON into the output
#      folder);
#   3. benchmarks/relax_overhead.py on CUDA: each stack's relaxation eager and replayed,
#      against a graphed GPT-B verify.
# A section that fails or runs out of time is reported and the next one runs.
#
#   bash benchmarks/gpu_check.sh [output folder, default ./gpu-check]
set -u
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
python -c "import specimg" 2>/dev/null || pip install --quiet --no-deps --no-build-isolation -e .  # a machine with torch but no specimg
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

section() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start)) s"
}

section cuda-tests 150 python -m pytest -q -rs tests/test_fixed_step.py tests/test_device_walk.py tests/test_draws.py
section gpu-quick 330 python benchmarks/gpu.py --quick --out "$out/gpu.json"
section relax-overhead 90 python benchmarks/relax_overhead.py --device cuda --repeats 5
