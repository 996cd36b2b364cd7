set -u
R=/tmp/r6; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
for m in table identity table identity; do timeout 100 python3 benchmarks/_probe_identity.py $m 2>&1 | grep -v Warn | tee -a $R/identity.log; done
cp benchmarks/_call6.sh $R/command.sh; cp benchmarks/_probe_identity.py $R/probe_identity.py
tar czf $OUT/r6.tgz -C /tmp r6
