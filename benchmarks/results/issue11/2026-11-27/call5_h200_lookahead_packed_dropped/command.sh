set -u
R=/tmp/r5; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
NEW=/tmp/app:/tmp/site
rm -rf /tmp/base; mkdir -p /tmp/base; cp -r kernels/attention_kernels /tmp/base/; cp benchmarks/_old_paging.py /tmp/base/attention_kernels/_paging.py
BASE=/tmp/base:/tmp/app:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
PYTHONPATH=$NEW timeout 130 python3 benchmarks/_probe_ptx.py $R/ptx 2>&1 | tail -2
grep -n "ld.global.b32\|cp.async.commit" $R/ptx/split_1.ptx | head -12
ab() { # side label args...
  local side=$1 label=$2; shift 2
  local pp=$NEW; [ $side = base ] && pp=$BASE
  PYTHONPATH=$pp timeout 150 python3 benchmarks/bench_paged.py "$@" --out $R/$label > $R/$label.log 2>&1
  echo "== $label rc=$?"
  grep -E "^(decode|prefill)" $R/$label.log | sed -E 's/\| paged\/cudnn.*GPU time/| GPU/' | cut -c1-200
}
ab new dec_new1 --only decode --quick --page-tokens 64,16
ab base dec_base1 --only decode --quick --page-tokens 64,16
ab new pre_new --only prefill --page-tokens 64,16
ab new dec_new_large --only decode --shapes 64:8192:128,128:2048:128,8:8192:64 --page-tokens 64,16
PYTHONPATH=$NEW timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 600 tests/kernels/test_paged.py tests/kernels/test_decode.py > $R/tests.log 2>&1
echo "tests rc=$?"; tail -2 $R/tests.log
cp benchmarks/_call5.sh $R/command.sh
tar czf $OUT/r5.tgz -C /tmp r5
