#!/usr/bin/env bash
# The native engine on an NVIDIA GPU, in one short run: the engine tests with the engine on CUDA
# (greedy output equal to transformers' fp32 reference, token for token), then the benches with
# the engine and transformers on the same GPU in bfloat16. bench/RESULTS.md ("On a GPU") holds
# the figures of the runs made so far.
#
#   bash scripts/cuda_check.sh            # python3 with a CUDA torch and requirements-dev.txt
#   OUT=some/dir bash scripts/cuda_check.sh   # where the logs and JSON go (default artifacts/cuda)
#   DEVICE=cpu TEST_LIMIT=60 bash scripts/cuda_check.sh   # a dry run of the script itself on a CPU host
#   STEPS="tests http" bash scripts/cuda_check.sh   # only these steps (default: all but http; WITH_HTTP=1 adds it)
#   The server steps (safety, http) need the server's packages too: requirements.txt, or on a host
#   where the GPU's torch comes with the image, its other packages as wheels on PYTHONPATH
#   (scripts/gpu_bundle.sh makes them, with the classifier's encoder, for a host without an index).
#
# Each step has a time limit and the next one runs whatever the last one did, so one run says
# everything it can. The logs name the GPU, the driver, torch and transformers.
set -u
OUT=${OUT:-artifacts/cuda}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, note how it ended
    local name=$1 limit=$2
    shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
        return
    fi
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    # SIGINT first: Python prints where an overrunning step was (and benches stop their servers).
    timeout -s INT -k 20 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc after $((SECONDS - start))s"
    tail -n "${TAIL:-40}" "$OUT/$name.log"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    lscpu | grep -m1 "Model name"
    $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/machine.txt"

# The engine-level tests run the engine on CUDA (tests/engine/native_harness.py, TEST_DEVICE);
# the kernel tests still run the C kernels on this host's CPU. The sanitizer build is CPU-only.
ENGINE_TEST_DEVICE=$DEVICE TAIL=25 step tests "${TEST_LIMIT:-240}" $PY -m pytest tests/engine -q -rs -p no:cacheprovider \
    --ignore=tests/engine/test_sanitizers.py ${PYTEST_ARGS:-}
# 390M (Qwen2.5-0.5B's shape) at 1 and 8 streams and the 30M reference at 32: ours (decode steps
# from CUDA graphs, and without them) vs transformers.
step peers "${PEERS_LIMIT:-180}" $PY -m bench.bench_peers --device "$DEVICE" --json "$OUT/bench_peers.json"
# The 30M reference at 1-64 streams, the chunked-prefill and prefix-cache checks, transformers alike.
step engine "${ENGINE_LIMIT:-150}" $PY -m bench.bench_engine --device "$DEVICE" --skip-generate-batch \
    --sections engine,transformers,chunked,prefix --json "$OUT/bench_engine.json"
# The same engine section without CUDA graphs (engine.cuda_graphs = "off"), in the same run.
step engine-nographs "${NOGRAPHS_LIMIT:-150}" $PY -m bench.bench_engine --device "$DEVICE" --cuda-graphs off \
    --sections engine --engine-only --json "$OUT/bench_engine_nographs.json"
# A 32-stream decode step stepped directly (median, and a profile of its Python), with and without graphs.
step profile "${PROFILE_LIMIT:-50}" $PY -m bench.step_profile --device "$DEVICE" --switch-intervals 0.005 --top 12
step profile-nographs "${PROFILE_LIMIT:-50}" $PY -m bench.step_profile --device "$DEVICE" --cuda-graphs off \
    --switch-intervals 0.005 --top 12
# The safety gate's cost on a GPU host (the classifier runs on the CPU beside the engine on the GPU):
# the default configuration (safety on) against safety off, 32 streams, 28M reference. 512 requests
# per round (64 take under a second on a GPU); transformers' CPU peer would say nothing here.
step safety "${SAFETY_LIMIT:-240}" $PY -m bench.bench_safety --set engine.device="$DEVICE" --skip-transformers \
    --num-requests "${SAFETY_REQUESTS:-512}" --json "$OUT/bench_safety.json" ${SAFETY_ARGS:-}
if [ -n "${WITH_HTTP:-}" ] || [[ " ${STEPS:-} " == *" http "* ]]; then
    step http "${HTTP_LIMIT:-150}" $PY -m bench.bench_engine --device "$DEVICE" --sections http --json "$OUT/bench_http.json"
fi
