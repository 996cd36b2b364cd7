set -u
R=/tmp/r4; rm -rf $R; mkdir -p $R
S=$(date +%s)
[ -d /tmp/app ] || (timeout 250 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
echo "install $(( $(date +%s) - S )) s"
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
# The attribute asked before and after torch initialized CUDA, without and with cuInit first.
python3 - > $R/attribute.txt 2>&1 <<'PY'
import ctypes, torch
lib = ctypes.CDLL("libcuda.so.1"); v = ctypes.c_int(0)
print("before init, no cuInit: rc", lib.cuDeviceGetAttribute(ctypes.byref(v), 91, 0), "value", v.value)
print("cuInit rc", lib.cuInit(0)); v.value = 0
print("after cuInit: rc", lib.cuDeviceGetAttribute(ctypes.byref(v), 91, 0), "value", v.value)
from attention_kernels.copy_segments import can_use_host_pointers
print("can_use_host_pointers(0) before torch init:", can_use_host_pointers(0))
torch.zeros(1, device="cuda")
print("torch initialized")
PY
cat $R/attribute.txt
timeout 300 python3 benchmarks/bench_copy_segments.py --out $R/copy_segments > $R/copy_segments.log 2>&1; echo rc=$?
cat $R/copy_segments.log
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_copy_segments.py tests/service/test_pack_kernel_gpu.py -rs > $R/pack_tests.log 2>&1; echo tests rc=$?
tail -8 $R/pack_tests.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call4.sh $R/command.sh
tar czf $OUT/r4.tgz -C /tmp r4
