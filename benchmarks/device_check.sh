#!/usr/bin/env bash
# The accelerator check: the test suite and the benchmarks on whatever JAX sees (GPU, TPU or CPU).
#
#   bash benchmarks/device_check.sh            # the suite, then benchmarks/run.py --quick
#   bash benchmarks/device_check.sh --full     # the full benchmark suite
#   TESTS="tests/test_grad.py" bash benchmarks/device_check.sh   # a subset of the suite
#
# It keeps the JAX already installed (an accelerator machine ships its own CUDA or TPU build):
# jaxtrace and the test tools are installed beside it with pip, never a replacement JAX. Where no
# JAX is installed it installs the default (CPU) one. Prints the versions (JAX, jaxlib, the
# devices, the NVIDIA driver where there is one), the suite's summary and the benchmark table,
# and writes the benchmark JSON to benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=--quick
[ "${1:-}" = "--full" ] && MODE=""
export PIP_DISABLE_PIP_VERSION_CHECK=1

if $PY -c "import jax" 2>/dev/null; then
    $PY -m pip install -q --no-deps -e . && $PY -m pip install -q "equinox>=0.13" pytest hypothesis optax matplotlib
else
    $PY -m pip install -q -e ".[test]"
fi || { echo "device_check: the install failed"; exit 1; }

echo "== versions"
$PY - <<'PY'
import platform, jax, jaxlib
print(f"python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")
print(f"backend {jax.default_backend()}: {jax.devices()}")
PY
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "(no NVIDIA driver)"

echo "== test suite"
$PY -m pytest -q ${TESTS:-tests} 2>&1 | tail -n 20
suite=${PIPESTATUS[0]}

echo "== benchmarks"
$PY benchmarks/run.py $MODE
bench=$?

echo "== device check: suite exit $suite, benchmarks exit $bench"
[ "$suite" -eq 0 ] && [ "$bench" -eq 0 ]
