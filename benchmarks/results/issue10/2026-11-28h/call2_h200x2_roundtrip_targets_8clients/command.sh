# Fetch call 1's folder (too many files to come back one by one)
P=$(find "$(dirname "$OUT")" /tmp -maxdepth 3 -type d -name r1 -path '*r1' 2>/dev/null | grep -v "^$OUT" | head -1); echo "call1 at $P"
[ -n "$P" ] && tar czf $OUT/r1.tgz -C "$(dirname "$P")" r1
R=/tmp/r2; source benchmarks/device_env.sh
rm -rf /tmp/baseline-tree && mkdir -p /tmp/baseline-tree && git archive 8091d8f | tar x -C /tmp/baseline-tree
timeout $(( 570 - ($(date +%s) - S) )) python3 benchmarks/bench_roundtrip.py --tokens 8192 --heads 16 --head-dim 128 --frontends 8 --clients 8,8,8,8 --agg-spread 1 --iters 3 --agg-seconds 5 --baseline-tree /tmp/baseline-tree --server-cpus "$SCPUS" --client-cpus "$CCPUS" --out $R/roundtrip > $R/roundtrip.log 2>&1; echo rc=$?
sed -n '/^ceilings/,$p' $R/roundtrip.log | grep -v "^  N=. *clients.*GB/s (" 
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call2.sh $R/command.sh
tar czf $OUT/r2.tgz -C /tmp r2
