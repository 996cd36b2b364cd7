set -u
R=/tmp/r3; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
timeout 120 python3 benchmarks/_probe_ptx.py $R/ptx 2>&1 | tail -5
which ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -2
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  for w in contiguous paged; do
    timeout 120 $NCU --profile-from-start off --set full -o $R/$w -f python3 benchmarks/probe_decode_ncu.py --which $w --batch 8 --ctx 8192 --page-tokens 64 > $R/ncu_$w.log 2>&1
    $NCU --import $R/$w.ncu-rep --page raw --csv > $R/$w.csv 2>/dev/null
  done
  python3 benchmarks/ncu_summary.py $R/contiguous.csv $R/paged.csv > $R/ncu_8x8k.txt 2>&1; cat $R/ncu_8x8k.txt | head -50
fi
rm -f $R/*.ncu-rep
cp benchmarks/_call3.sh $R/command.sh
tar czf $OUT/r3.tgz -C /tmp r3
