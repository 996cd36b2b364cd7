set -u
R=/tmp/r1; rm -rf $R; mkdir -p $R
S=$(date +%s)
[ -d /tmp/app ] || (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
echo "install $(( $(date +%s) - S )) s"
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
timeout 200 bash benchmarks/gpu_checks.sh $R service-tests > $R/stages.log 2>&1; echo "service-tests rc=$?"
tail -3 $R/service-tests.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_copy_segments.py tests/service/test_pack_kernel_gpu.py > $R/copy_segments_tests.log 2>&1; echo "copy tests rc=$?"
tail -2 $R/copy_segments_tests.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call1.sh $R/command.sh
tar czf $OUT/r1.tgz -C /tmp r1
