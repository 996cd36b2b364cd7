R=/tmp/r1; source benchmarks/device_env.sh
for i in 1 2; do
  for mode in spread no-spread; do
    flag=""; [ $mode = no-spread ] && flag="--no-spread"
    timeout 140 python3 benchmarks/bench_service.py --duration 8 --warmup 2 --prime 3 --clients 64 --max-len 256 $flag --out $R/service_${mode}_$i > $R/service_${mode}_$i.log 2>&1; echo "$mode $i rc=$?"
    grep -E "clients +64:" $R/service_${mode}_$i.log | sed -E 's/ p50.*errors/ ... errors/'
    grep -E "^ +64 " $R/service_${mode}_$i.log
    echo "at $(( $(date +%s) - S )) s"
  done
done
cp benchmarks/_call1.sh $R/command.sh
tar czf $OUT/r1.tgz -C /tmp r1
