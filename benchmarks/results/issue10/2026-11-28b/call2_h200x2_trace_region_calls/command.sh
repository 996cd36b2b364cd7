R=/tmp/r2; source benchmarks/device_env.sh
for fe in 8 1; do
  mkdir -p $R/trace_fe$fe
  TRACE_DIR=$R/trace_fe$fe PYTHONPATH=$PWD/benchmarks/_trace:$PYTHONPATH timeout 200 taskset -c "$CCPUS" python3 benchmarks/_trace/trace_path.py "$SCPUS" $fe > $R/trace_fe$fe.log 2>&1; echo "fe=$fe rc=$?"
  cat $R/trace_fe$fe.log | grep -v "^\s*$" | tail -6
  python3 benchmarks/_trace/analyze.py $R/trace_fe$fe | tee $R/analysis_fe$fe.txt
done
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call2.sh $R/command.sh; cp benchmarks/_trace/*.py $R/
tar czf $OUT/r2.tgz -C /tmp r2
