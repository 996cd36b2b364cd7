R=/tmp/r4; source benchmarks/device_env.sh
rm -rf /tmp/baseline-tree && mkdir -p /tmp/baseline-tree && git archive 8091d8f | tar x -C /tmp/baseline-tree
timeout $(( 560 - ($(date +%s) - S) )) python3 benchmarks/bench_roundtrip.py --tokens 8192 --heads 16 --head-dim 128 --frontends 8 --clients 16,16 --agg-spread 1 --iters 3 --agg-seconds 5 --baseline-tree /tmp/baseline-tree --server-cpus "$SCPUS" --client-cpus "$CCPUS" --out $R/roundtrip16 > $R/roundtrip16.log 2>&1; echo rc=$?
sed -n '/^aggregate/,$p' $R/roundtrip16.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call4.sh $R/command.sh
tar czf $OUT/r4.tgz -C /tmp r4
