set -u
R=/tmp/r4; rm -rf $R; mkdir -p $R
(timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
timeout 200 python3 benchmarks/profile_group.py --out $R/prof --path grpc --batching on --frontends 0 --load-arg=--max-len=256 > $R/profile.log 2>&1; echo "profile rc=$?"
head -45 $R/prof/pyspy_engine*_summary.txt 2>/dev/null | head -45
timeout 150 python3 benchmarks/bench_service.py --duration 8 --warmup 2 --prime 3 --clients 64 --max-len 256 --out $R/service > $R/service.log 2>&1; echo "service rc=$?"; grep -E "clients +64:" $R/service.log
cp benchmarks/_call4.sh $R/command.sh
tar czf $OUT/r4.tgz -C /tmp r4
