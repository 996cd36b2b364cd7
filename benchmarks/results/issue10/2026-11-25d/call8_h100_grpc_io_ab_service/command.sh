set -u
rm -rf /tmp/r7; mkdir -p /tmp/r7
(timeout 200 bash benchmarks/gpu_checks.sh /tmp/r7 >/tmp/r7/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > /tmp/r7/gpu.txt
timeout 520 bash benchmarks/ab_env.sh /tmp/r7/ab GRPC_EXPERIMENTS "-event_engine_client,-event_engine_listener event_engine_client" 2 benchmarks/bench_service.py --duration 8 --warmup 2 --prime 3 --clients 64 --max-len 256 > /tmp/r7/ab.txt 2>&1
for f in /tmp/r7/ab/*.log; do echo "== $f"; grep -E "^\| *64|on/off|ratio" $f | head -8; done
