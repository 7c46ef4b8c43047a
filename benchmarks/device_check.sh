#!/usr/bin/env bash
# The accelerator check: a part of the suite and the benchmarks on whatever JAX sees (GPU, TPU or
# CPU), on a machine that reaches no package index. It installs nothing and builds nothing.
#
#   bash benchmarks/device_check.sh                          # every part, 9 minutes at most
#   TESTS="tests/test_grad.py" bash benchmarks/device_check.sh   # another part of the suite
#   PARTS="versions tests" bash benchmarks/device_check.sh       # some parts only
#   LOGS=/some/dir bash benchmarks/device_check.sh               # where the logs go
#
# It needs a Python (PYTHON, default python3) that already has JAX (the machine's CUDA or TPU
# build), equinox, pytest and hypothesis (pytest-xdist, optax and torch where present are used);
# jaxtrace is imported from this checkout through PYTHONPATH, not installed. The parts, each under
# its own time limit (seconds, in brackets) with its log kept in $LOGS/<part>.log:
#
#   versions   [30]   Python, JAX, jaxlib, the devices, the NVIDIA driver, where jaxtrace comes from
#   tests      [120]  pytest on $TESTS, $WORKERS workers sharing the accelerator (no preallocation)
#   run        [80]   benchmarks/run.py --quick, the models only (its JSON is $LOGS/run.json)
#   peers      [150]  benchmarks/per_example_peers.py: GPU sizes on a GPU, --quick elsewhere
#   stats      [40]   benchmarks/stats_step.py, a few rounds
#   nonfinite  [60]   benchmarks/nonfinite_peers.py, a few rounds, a process per program
#   spike      [60]   benchmarks/spike_history.py, a few rounds: the NormHistory step against the plain
#                     step (issue 52's 1.02x; no GPU figure yet)
#
# It prints each part's status and the end of its log, and exits 0 when every part it ran did.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
PARTS=${PARTS:-versions tests run peers stats nonfinite spike}
LOGS=${LOGS:-$ROOT/benchmarks/results/device-check-$(date +%Y%m%d-%H%M%S)}
TESTS=${TESTS:-tests/test_grad.py tests/test_transforms.py tests/test_cost.py tests/test_stats.py tests/test_nonfinite.py tests/test_per_example.py tests/test_device_check.py}
mkdir -p "$LOGS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several test workers share one accelerator
export PIP_NO_INDEX=1                       # nothing below may reach for an index

# The workers: where pytest-xdist is installed, one per two cores, at most 8; else one.
if $PY -c "import xdist" 2>/dev/null; then
    half=$(( $(nproc) / 2 )); [ "$half" -ge 1 ] || half=1; [ "$half" -le 8 ] || half=8
    WORKERS=${WORKERS:-$half}
    XDIST="-n $WORKERS"
else
    WORKERS=1 XDIST=""
fi
GPU=$($PY -c "import jax; print(int(jax.default_backend() == 'gpu'))" 2>/dev/null || echo 0)

part_versions() {
    $PY - <<'PY'
import importlib, os, platform
import jax, jaxlib
import jaxtrace
print(f"python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
      f"jaxtrace {jaxtrace.__version__} from {os.path.dirname(jaxtrace.__file__)}")
print(f"backend {jax.default_backend()}: {jax.device_count()} device(s), {jax.devices()[0].device_kind}: {jax.devices()}")
for name in ("equinox", "optax", "flax", "torch", "pytest", "xdist", "hypothesis"):
    try:
        module = importlib.import_module(name)
        extra = ""
        if name == "torch":
            extra = f" (CUDA {module.version.cuda}, available: {module.cuda.is_available()})"
        print(f"{name} {getattr(module, '__version__', '?')}{extra}")
    except Exception as e:
        print(f"{name}: not importable ({type(e).__name__})")
PY
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "(no NVIDIA driver)"
}

part_tests() {
    # shellcheck disable=SC2086
    $PY -m pytest -q $XDIST -p no:cacheprovider $TESTS
}

part_run() {
    $PY benchmarks/run.py --quick --no-large --no-scaling --sweep none --out "$LOGS/run.json"
}

part_peers() {
    if [ "$GPU" = 1 ]; then
        $PY benchmarks/per_example_peers.py --sizes gpu --rounds 3 --models mlp,cnn  # the 4-block transformer: run it alone (it took over 60 s more on an H200)
    else
        $PY benchmarks/per_example_peers.py --quick --models mlp,cnn,transformer
    fi
}

part_stats() {
    $PY benchmarks/stats_step.py --rounds 5 --models mlp,cnn
}

part_nonfinite() {  # a process per program: a peer that aborts the process (XLA's own checks) stops only its program
    local rc=0 name
    while IFS= read -r name; do
        $PY benchmarks/nonfinite_peers.py --rounds 3 --no-torch --only "$name" || { echo "(exit $? in: $name)"; rc=1; }
    done < <($PY benchmarks/nonfinite_peers.py --list)
    return $rc
}

part_spike() {  # without the attention model (1.02x met on CPU; the longest to compile)
    $PY benchmarks/spike_history.py --rounds 5 --models guide,mlp,rnn,cnn
}

limit_of() {
    case $1 in
        versions) echo 30 ;; tests) echo 120 ;; run) echo 80 ;; peers) echo 150 ;; stats) echo 40 ;; nonfinite) echo 60 ;; spike) echo 60 ;;
    esac
}

STATUS=0
SUMMARY=()
START=$(date +%s)
for part in $PARTS; do
    if ! declare -F "part_$part" >/dev/null; then
        echo "device_check: there is no part '$part' (the parts: versions tests run peers stats nonfinite spike)" >&2
        exit 2
    fi
    limit=${LIMIT:-$(limit_of "$part")}
    t0=$(date +%s)
    echo "== $part (at most ${limit} s; log $LOGS/$part.log)"
    export -f "part_$part"
    export PY XDIST TESTS LOGS GPU
    timeout --kill-after=10 "$limit" bash -c "part_$part" >"$LOGS/$part.log" 2>&1
    rc=$?
    seconds=$(( $(date +%s) - t0 ))
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        verdict="TIMED OUT after ${limit} s"
    elif [ "$rc" -ne 0 ]; then
        verdict="FAILED (exit $rc)"
    else
        verdict="passed"
    fi
    [ "$rc" -eq 0 ] || STATUS=1
    tail -n 25 "$LOGS/$part.log"
    SUMMARY+=("$(printf '%-10s %-26s %4s s' "$part" "$verdict" "$seconds")")
done
echo "== device check ($(( $(date +%s) - START )) s; logs in $LOGS)"
printf '%s\n' "${SUMMARY[@]}" | tee "$LOGS/summary.txt"
exit "$STATUS"
