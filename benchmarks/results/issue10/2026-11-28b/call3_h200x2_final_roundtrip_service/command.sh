R=/tmp/r3; source benchmarks/device_env.sh
rm -rf /tmp/baseline-tree && mkdir -p /tmp/baseline-tree && git archive 8091d8f | tar x -C /tmp/baseline-tree
timeout 150 python3 benchmarks/bench_service.py --duration 8 --warmup 2 --prime 3 --clients 64 --max-len 256 --server-cpus "$SCPUS" --client-cpus "$CCPUS" --out $R/service > $R/service.log 2>&1; echo "service rc=$?"
grep -E "clients +64:|^ +64 |x |ratio" $R/service.log | head -12
echo "service done $(( $(date +%s) - S )) s"
timeout $(( 590 - ($(date +%s) - S) )) python3 benchmarks/bench_roundtrip.py --tokens 8192 --heads 16 --head-dim 128 --frontends 8 --clients 8,8,8,8 --agg-spread 1 --iters 3 --agg-seconds 5 --baseline-tree /tmp/baseline-tree --server-cpus "$SCPUS" --client-cpus "$CCPUS" --out $R/roundtrip > $R/roundtrip.log 2>&1; echo rc=$?
sed -n '/^ceilings/,$p' $R/roundtrip.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call3.sh $R/command.sh
tar czf $OUT/r3.tgz -C /tmp r3
