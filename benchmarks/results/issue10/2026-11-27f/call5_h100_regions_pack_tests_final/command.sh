set -u
R=/tmp/r5; rm -rf $R; mkdir -p $R
S=$(date +%s)
[ -d /tmp/app ] || (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
echo "install $(( $(date +%s) - S )) s"
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
timeout 400 python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/service/test_regions_gpu.py tests/service/test_pack_kernel_gpu.py tests/kernels/test_copy_segments.py > $R/regions_pack_tests.log 2>&1; echo "tests rc=$?"
tail -3 $R/regions_pack_tests.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call5.sh $R/command.sh
tar czf $OUT/r5.tgz -C /tmp r5
