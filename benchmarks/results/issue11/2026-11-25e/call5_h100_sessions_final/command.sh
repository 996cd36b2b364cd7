set -u
R=/tmp/r5; rm -rf $R; mkdir -p $R
[ -d /tmp/app ] || (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
timeout 540 bash benchmarks/gpu_checks.sh $R sessions > $R/stages.log 2>&1
echo "sessions rc=$?"
grep -hE "^\| sessions|overhead over kernel at 1 client|bare gRPC echo|resend|on/off" $R/*.md $R/*.log 2>/dev/null | head -30
cp benchmarks/_tmp_final_b.sh $R/command.sh
tar czf $OUT/r5.tgz -C /tmp r5
