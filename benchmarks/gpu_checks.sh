#!/usr/bin/env bash
# GPU checks and benchmarks in one command, for a GPU host that has torch, triton and pytest
# (e.g. the CUDA image of docs/deploy.md, or a dev box):
#
#   bash benchmarks/gpu_checks.sh OUT_DIR STAGE...
#
# Stages (run in the order given; each writes its log and results under OUT_DIR):
#   tests      GPU tests: kernels at full shapes, the cuda service, batching and region tests
#   service-tests  the cuda service, batching and region (CUDA IPC) tests alone
#   warmup     benchmarks/bench_warmup.py (kernel warm-up from an empty Triton cache, in-process
#              and with 16 worker processes, then a restart on the filled cache)
#   kernels    benchmarks/bench_kernels.py (prefill/decode vs SDPA cuDNN/FLASH and varlen_attn)
#   tune-fp8   FP8 kernel tests on the GPU, then tools/tuning/tune_fp8.py (the e4m3 conversions'
#              PTX, tile configs, descriptor loads of FP8 tiles)
#   tune-fp8-paged  tools/tuning/tune_fp8.py --only paged (FP8 pages: paged decode tile configs)
#   hopper-prefill  tools/tuning/tune_hopper_prefill.py (the Gluon Hopper prefill: checks against
#              the float64 reference, then tiles / consumer counts / persistent launches vs
#              SDPA cuDNN and FLASH and the portable kernel; HOPPER_PREFILL_ARGS adds options)
#   prefill-order  tools/tuning/tune_prefill_order.py (the prefill grid's program order, vs cuDNN)
#   paged      benchmarks/bench_paged.py (paged-KV decode/prefill vs contiguous and SDPA cuDNN)
#   features   sliding window / softcap / ALiBi: tests/kernels/test_features.py on the GPU, then
#              benchmarks/bench_features.py (window skip vs full causal, varlen_attn and SDPA
#              with a mask; softcap and ALiBi overhead; windowed decode)
#   roundtrip  benchmarks/bench_roundtrip.py (8192 tokens x 16 heads x 128 bf16, loopback):
#              every data path with 1, 2, 4 and 8 front ends, aggregate gRPC at 8 and 16 clients
#   roundtrip-baseline  the roundtrip stage's aggregate with 8 front ends against the server of
#              BASELINE_COMMIT (default 8091d8f, the last commit before the process group: issue
#              10's "today's single process"), measured before and after this tree's servers
#   transfer   tools/tuning/tune_transfer.py (message size, HTTP/2 settings, channels per client)
#   service    benchmarks/bench_service.py (dynamic batching on vs off, 1..64 clients; gRPC bytes,
#              the default front-end count)
#   service-shm  the same with the load's tensors in registered shared memory (--path shm)
#   trace-step benchmarks/trace_step.py: one client's decode step, a timestamp at every hand-off
#              in every server process (steps on one stream, then unary calls, at the default
#              front-end count; then steps on one stream with --frontends 1)
#   batching   benchmarks/bench_batching.py (the batching executor alone, no gRPC, 1..128)
#   sigterm-warmup  SIGTERM 5 s into a cold warm-up (a pod stopped while it starts), the
#              process group and the single process: exit code and seconds to exit
#   sessions   benchmarks/bench_sessions.py (decode through server-side KV caches vs re-sending
#              the cache; batching on/off; 1, 8, 64 clients), after a short throwaway run
#   sessions-fp8  the same with FP8 (e4m3) keys and values: FP8 caches and FP8 resends
#              (batching on; 1 and 64 clients)
#   soak       benchmarks/soak.py: SOAK_SECONDS (default 600) of mixed Locust load (SOAK_USERS,
#              32) plus a concurrent stream of bad inputs and cut-off calls; memory sampled
#   locust     the server started as the container starts it (attention-server, ATTENTION_*
#              variables), a headless Locust run of LOCUST_TIME (default 3m) with LOCUST_USERS
#              (32) users in LOCUST_PROCESSES load processes (default: one), then SIGTERM
#
# Python packages the host lacks can come as wheels in ./.whl (installed into /tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_checks.sh OUT_DIR STAGE...}
shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CC=${CC:-gcc}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}

if compgen -G ".whl/*.whl" >/dev/null && [ ! -e /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site/.done
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if ! command -v attention-server >/dev/null; then
  # The project itself, as the image installs it (console script included). Afresh on every
  # call: a warm machine keeps /tmp, and pip --target leaves an existing copy in place, so a
  # second call would otherwise test the first call's code.
  # GPU_CHECKS_APP: another folder lets a second run go on beside a long one (e.g. a soak).
  APP=${GPU_CHECKS_APP:-/tmp/app}
  rm -rf "$APP"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --target "$APP" . ./client || exit 1
  export PATH=$APP/bin:$PATH PYTHONPATH=$APP:$PYTHONPATH
fi

status=0
stage() {  # stage NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $* ($(date -u +%H:%M:%S))"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || status=1
}

baseline_tree() {  # BASELINE_COMMIT's source tree in /tmp/baseline-tree
  rm -rf /tmp/baseline-tree && mkdir -p /tmp/baseline-tree \
    && git archive "${BASELINE_COMMIT:-8091d8f}" | tar x -C /tmp/baseline-tree
}

locust_run() {
  local port=50051 mport=8000
  ATTENTION_HOST=127.0.0.1 ATTENTION_PORT=$port ATTENTION_METRICS_PORT=$mport \
    ATTENTION_DEVICE=cuda ATTENTION_LOG_LEVEL=WARNING attention-server &
  local pid=$!
  local t0=$SECONDS
  until python3 deploy/healthcheck.py "127.0.0.1:$port" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "server exited"; return 1; fi
    sleep 2
  done
  echo "server SERVING after $((SECONDS - t0)) s"
  python3 -m locust -f loadtest/locustfile.py --headless -u "${LOCUST_USERS:-32}" -r 8 \
    -t "${LOCUST_TIME:-3m}" --stop-timeout 30 --host "127.0.0.1:$port" --csv "$OUT/locust" \
    --only-summary ${LOCUST_PROCESSES:+--processes "$LOCUST_PROCESSES"}
  local rc=$?
  python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
    "http://127.0.0.1:$mport/metrics" > "$OUT/locust_metrics.txt" || true
  kill -TERM "$pid"
  wait "$pid"
  local src=$?
  echo "locust rc=$rc, server exit after SIGTERM: $src"
  [ "$rc" = 0 ] && [ "$src" = 0 ]
}

sigterm_warmup() {  # both server kinds stopped 5 s into a warm-up from an empty Triton cache
  local cache fe log pid warm t0 rc
  cache=$(mktemp -d)
  for fe in 0 1; do
    log=$OUT/sigterm_warmup_frontends$fe.log
    TRITON_CACHE_DIR=$cache python3 -m attention_service --host 127.0.0.1 --port 0 \
      --device cuda --metrics-port -1 --grace-seconds 1 --frontends $fe > "$log" 2>&1 &
    pid=$!
    for _ in $(seq 1 240); do grep -q "kv cache pool" "$log" && break; sleep 0.5; done
    sleep 5
    warm=$(grep -c "warm-up on" "$log")
    t0=$(date +%s.%N); kill -TERM $pid; wait $pid; rc=$?
    echo "frontends=$fe rc=$rc warm_before_signal=$warm seconds_to_exit=$(python3 -c \
      "print(round($(date +%s.%N) - $t0, 2))")" | tee -a "$OUT/sigterm_warmup.txt"
  done
  rm -rf "$cache"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, grpc; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'grpcio', grpc.__version__)" | tee -a "$OUT/gpu.txt"

# The service's GPU tests (the cuda service, batching, CUDA IPC regions, KV caches, decode
# steps, FP8, the process group on cuda): the tests and service-tests stages run them.
SERVICE_GPU_TESTS="tests/service/test_service_gpu.py tests/service/engine/test_batching_gpu.py
  tests/service/engine/test_regions_gpu.py tests/service/engine/test_kv_caches_gpu.py
  tests/service/engine/test_decode_steps_gpu.py tests/service/engine/test_fp8_gpu.py
  tests/service/ipc/test_process_group_gpu.py tests/service/engine/test_pack_kernel_gpu.py"

# Test runs start many warm-ups at once (pytest workers, test servers): 2 compile workers each.
TEST_WARMUP_WORKERS=${ATTENTION_KERNELS_WARMUP_WORKERS:-2}

for s in "$@"; do
  case $s in
    warmup) stage warmup 900 python3 benchmarks/bench_warmup.py \
              --workers "${WARMUP_WORKERS:-1,16}" --out "$OUT" ;;
    tests) ATTENTION_KERNELS_WARMUP_WORKERS=$TEST_WARMUP_WORKERS stage tests 540 python3 -m pytest -q -p no:cacheprovider -n 6 --timeout 600 \
             tests/kernels $SERVICE_GPU_TESTS ;;
    service-tests) ATTENTION_KERNELS_WARMUP_WORKERS=$TEST_WARMUP_WORKERS stage service-tests 540 python3 -m pytest -q -p no:cacheprovider -n 4 \
             --timeout 600 $SERVICE_GPU_TESTS ;;
    kernels) stage kernels 420 python3 benchmarks/bench_kernels.py --out "$OUT" ;;
    tune-fp8) stage fp8-tests 300 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 600 \
                tests/kernels/test_fp8.py tests/service/engine/test_fp8_gpu.py
              stage tune-fp8 420 python3 tools/tuning/tune_fp8.py --out "$OUT" ;;
    tune-fp8-paged) stage tune-fp8-paged 300 python3 tools/tuning/tune_fp8.py --only paged \
                      --out "$OUT" ;;
    hopper-prefill) stage hopper-prefill 580 python3 tools/tuning/tune_hopper_prefill.py \
      --out "$OUT" ${HOPPER_PREFILL_ARGS:-} ;;
    prefill-order) stage prefill-order 300 python3 tools/tuning/tune_prefill_order.py \
                     --out "$OUT" ;;
    paged) stage paged 420 python3 benchmarks/bench_paged.py --out "$OUT" ;;
    features) stage features-tests 360 python3 -m pytest -q -p no:cacheprovider -n 4 \
                --timeout 600 tests/kernels/test_features.py
              stage features 420 python3 benchmarks/bench_features.py --out "$OUT" ;;
    roundtrip) stage roundtrip 420 python3 benchmarks/bench_roundtrip.py --tokens 8192 \
                 --heads 16 --head-dim 128 --frontends 2,4,8 --clients 8,16 --iters 20 \
                 --agg-seconds 6 --out "$OUT" ;;
    trace-step) stage trace-step 200 python3 benchmarks/trace_step.py --stream --out "$OUT"
                stage trace-step-unary 200 python3 benchmarks/trace_step.py --out "$OUT"
                stage trace-step-1fe 200 python3 benchmarks/trace_step.py --stream \
                  --frontends 1 --out "$OUT" ;;
    roundtrip-baseline)
      baseline_tree || exit 1
      stage roundtrip-baseline 560 python3 benchmarks/bench_roundtrip.py --tokens 8192 \
        --heads 16 --head-dim 128 --frontends 8 --clients 8,16 --iters 10 \
        --agg-seconds 6 --baseline-tree /tmp/baseline-tree --out "$OUT" ;;
    transfer) stage transfer 170 python3 tools/tuning/tune_transfer.py --iters 4 --seconds 5 \
                --out "$OUT" ;;
    service) stage service 300 python3 benchmarks/bench_service.py --duration 8 --warmup 2 \
               --prime 3 --clients 1,8,32,64 --out "$OUT" ;;
    service-shm) stage service-shm 300 python3 benchmarks/bench_service.py --duration 8 \
               --warmup 2 --prime 3 --clients 1,8,32,64 --path shm --out "$OUT" ;;
    batching) stage batching 300 python3 benchmarks/bench_batching.py --out "$OUT" ;;
    sigterm-warmup) export OUT; export -f sigterm_warmup
                    stage sigterm-warmup 400 bash -c sigterm_warmup ;;
    # A short throwaway run first: the first server of a device call measured 0.1-0.3 ms
    # slower at one client whichever side it ran (git history: benchmarks/results/issue11/
    # h100_2026-11-25b, 2026-11-25d), and
    # `on` is always bench_sessions' first server.
    sessions) stage sessions-settle 150 python3 benchmarks/bench_sessions.py --duration 2 \
                --warmup 1 --clients 1 --sides on --out "$OUT/settle"
              stage sessions 560 python3 benchmarks/bench_sessions.py --duration 6 --warmup 2 \
                --clients 1,8,64 --out "$OUT" ;;
    sessions-fp8) stage sessions-fp8 400 python3 benchmarks/bench_sessions.py --duration 6 \
                --warmup 2 --clients 1,64 --sides on,resend --kv-dtype fp8 --out "$OUT" ;;
    soak) stage soak $(( ${SOAK_SECONDS:-600} + 240 )) python3 benchmarks/soak.py \
            --duration "${SOAK_SECONDS:-600}" --users "${SOAK_USERS:-32}" --out "$OUT" ;;
    locust) export OUT; export -f locust_run; stage locust 420 bash -c locust_run ;;
    *) echo "unknown stage $s"; status=1 ;;
  esac
done
exit $status
