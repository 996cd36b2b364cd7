set -u
R=/tmp/r3; rm -rf $R; mkdir -p $R
S=$(date +%s)
[ -d /tmp/app ] || (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
echo "install $(( $(date +%s) - S )) s"
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_copy_segments.py tests/service/test_pack_kernel_gpu.py > $R/pack_tests.log 2>&1; echo "pack tests rc=$?"
tail -2 $R/pack_tests.log
echo "at $(( $(date +%s) - S )) s"
timeout 430 bash benchmarks/gpu_checks.sh $R service-tests > $R/stages.log 2>&1; echo "service-tests rc=$?"
tail -3 $R/service-tests.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call3.sh $R/command.sh
tar czf $OUT/r3.tgz -C /tmp r3
