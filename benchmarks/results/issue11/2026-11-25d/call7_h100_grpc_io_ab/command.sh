set -u
rm -rf /tmp/r6; mkdir -p /tmp/r6
(timeout 200 bash benchmarks/gpu_checks.sh /tmp/r6 >/tmp/r6/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > /tmp/r6/gpu.txt
timeout 120 python3 benchmarks/bench_sessions.py --sides on --clients 1 --duration 2 --warmup 1 --out /tmp/r6/settle > /tmp/r6/settle.log 2>&1
timeout 330 bash benchmarks/ab_env.sh /tmp/r6/ab GRPC_EXPERIMENTS "-event_engine_client,-event_engine_listener event_engine_client" 3 benchmarks/bench_sessions.py --sides on --clients 1,64 --duration 5 --warmup 2 > /tmp/r6/ab.txt 2>&1
grep -E "===|\| sessions|echo" /tmp/r6/ab.txt
timeout 150 bash benchmarks/gpu_checks.sh /tmp/r6 service-tests > /tmp/r6/service_tests_stage.log 2>&1; tail -3 /tmp/r6/service_tests_stage.log
