set -u
R=/tmp/r7; rm -rf $R; mkdir -p $R
[ -d /tmp/app ] || (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
timeout 560 bash benchmarks/gpu_checks.sh $R roundtrip-baseline > $R/stages.log 2>&1; echo "rc=$?"
sed -n '/^prefill/,$p' $R/roundtrip-baseline.log
cp benchmarks/_call7.sh $R/command.sh
tar czf $OUT/r7.tgz -C /tmp r7
