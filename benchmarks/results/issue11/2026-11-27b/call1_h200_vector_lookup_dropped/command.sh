set -u
R=/tmp/r1; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
for m in table vector identity vector table; do
  TRITON_CACHE_DIR=/tmp/tc-$m timeout 150 python3 benchmarks/probe_paged_lookup.py $m 2>&1 | grep -v Warn | tee -a $R/lookup.log
done
mkdir -p $R/ir
for m in table vector; do for f in $(find /tmp/tc-$m -name '_decode_split_kernel.ttgir'); do cp $f $R/ir/$m-$(basename $(dirname $f)).ttgir; done; done
cp benchmarks/_call1.sh $R/command.sh
tar czf $OUT/r1.tgz -C /tmp r1
