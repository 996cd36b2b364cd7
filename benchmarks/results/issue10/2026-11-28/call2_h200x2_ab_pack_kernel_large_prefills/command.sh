set -u
R=/tmp/r2; rm -rf $R; mkdir -p $R
S=$(date +%s)
[ -d /tmp/app ] || (timeout 250 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
echo "install $(( $(date +%s) - S )) s"
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
read SCPUS CCPUS < <(lscpu -p=CPU,CORE,NODE | grep -v '^#' | sort -t, -k3,3n -k2,2n -k1,1n | awk -F, '{c[NR]=$1} END {h=NR/2; for(i=1;i<=NR;i++){ if(i<=h) s=s (s?",":"") c[i]; else t=t (t?",":"") c[i]}; print s, t}')
echo "server cpus $SCPUS; client cpus $CCPUS" | tee $R/split.txt
# Large batches through the one-launch packing (ATTENTION_PACK_KERNEL=1, the default) against
# the per-job copies (0): 16 clients of 2048-token non-causal prefills, 8 front ends.
timeout $(( 570 - ($(date +%s) - S) )) bash benchmarks/ab_env.sh $R/ab ATTENTION_PACK_KERNEL "0 1" 2 \
  benchmarks/bench_service.py --batching on --clients 16 --min-len 2048 --max-len 2048 --no-causal \
  --heads 16 --kv-heads 16 --head-dim 128 --frontends 8 --duration 6 --warmup 2 --verify 4 \
  --server-cpus "$SCPUS" --client-cpus "$CCPUS" > $R/ab.log 2>&1; echo rc=$?
cat $R/ab.log
for f in $R/ab/*.log; do echo "== $f"; grep -E "req/s|batch|clients" $f | tail -6; done
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call2.sh $R/command.sh
tar czf $OUT/r2.tgz -C /tmp r2
