#!/usr/bin/env bash
# The checks that need a CUDA device, in one run (a lent GPU machine: python3 with
# torch and Triton, no network). Writes its logs under $OUT (default /tmp/kvtier-device):
#   gpu.txt       the device, driver, torch and Triton versions
#   pytest.log    the gpu-marked tests and the compiled-kernel checks
#   kernels.log   python -m bench.kernels --device cuda (last line: its JSON), after a
#                 --quick warm-up pass (kernels-warmup.log)
# Packages the machine lacks travel as wheels in .whl/ (see bench/RESULTS.md, "GPU").
#   scripts/device_check.sh          the tests, then the kernel benchmark
#   scripts/device_check.sh bench    the kernel benchmark alone
set -uo pipefail
mode=${1:-all}
OUT=${OUT:-/tmp/kvtier-device}
mkdir -p "$OUT"
deps=/tmp/kvtier-deps
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$deps" .whl/*.whl || exit 1
fi
python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null || {
    echo "no CUDA device here: this script is for a GPU machine" >&2
    exit 2
}
# The import names kvtier.<component> map onto top-level folders (setup.py's ROOTS). This
# copy of the tree is the machine's own: link them into kvtier/ instead of building the
# distribution (python -m and pytest put the repository first on sys.path).
for component in kernels engine connectors server router bench; do
    ln -sfn "$PWD/$component" "kvtier/$component"
done
export PYTHONPATH="$PWD:$deps" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
    nproc
} 2>&1 | tee "$OUT/gpu.txt"

status=0
if [ "$mode" = all ]; then
    timeout 300 python3 -m pytest -p no:cacheprovider -q \
        tests/kernels/test_kernel_gpu.py tests/kernels/test_kernel_compile.py \
        tests/engine/test_gpu.py tests/vllm/test_layout.py 2>&1 | tee "$OUT/pytest.log" || status=1
fi
# The first shape of a first run read slow on an H200 (gather of the smaller chunk 53 us, of
# the larger 25 us): a --quick pass first, kept in its own log, then the run that is reported.
timeout 100 python3 -m bench.kernels --device cuda --quick >"$OUT/kernels-warmup.log" 2>&1 || status=1
nvidia-smi --query-gpu=clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/gpu.txt"
timeout 200 python3 -m bench.kernels --device cuda 2>&1 | tee "$OUT/kernels.log" || status=1
exit $status
