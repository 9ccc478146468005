#!/usr/bin/env bash
# The GPU checks, for a machine with a CUDA GPU (CI has none): run from the repository root
# with `bash benchmarks/gpu_check.sh [OUTDIR]`. Each part runs under its own time limit and
# the next runs whatever the last gave; logs and JSON land in OUTDIR (default $OUT, else
# /tmp/meshcomm-gpu). The parts:
#   1. tests/test_cuda.py: every plan kind on CUDA tensors, a rank of 1,024 without host
#      syncs, a one-GPU NCCL job;
#   2. benchmarks/host_scale.py --device cuda: host time per step with CUDA tensors at
#      8 to 4,096 ranks beside PyTorch (fake process group);
#   3. benchmarks/gpu_train.py: a bf16 training step on one NCCL rank, FSDP2 beside meshcomm.
set -u
out=${1:-${OUT:-/tmp/meshcomm-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
if [ -d .whl ]; then   # wheels carried to a machine with no network (pydantic and its needs)
    $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/meshcomm-site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/meshcomm-site"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $py -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
} 2>&1 | tee "$out/gpu.txt"
echo "== 1. tests/test_cuda.py"
timeout 300 $py -m pytest tests/test_cuda.py -rA -q -p no:cacheprovider 2>&1 | tee "$out/test_cuda.log"
echo "== 2. host_scale --device cuda"
timeout 300 $py benchmarks/host_scale.py --device cuda --repeat 5 \
    --json "$out/host_scale_cuda.json" 2>&1 | grep -v Warning | tee "$out/host_scale_cuda.log"
echo "== 3. gpu_train"
timeout 240 $py benchmarks/gpu_train.py --json "$out/gpu_train.json" 2>&1 | tee "$out/gpu_train.log"
if [ "${CPU_SUITE:-0}" = 1 ]; then   # this torch on the CPU tests of the training blocks
    echo "== 4. CPU tests on this machine's torch"
    timeout 200 $py -m pytest -q -x -p no:cacheprovider -n 8 tests/dist/test_fsdp.py \
        tests/dist/test_parallel.py tests/dist/test_reshard.py tests/dist/test_ties.py \
        tests/dist/test_hsdp.py tests/test_meta_device.py 2>&1 | tail -40 | tee "$out/cpu_suite.log"
fi
