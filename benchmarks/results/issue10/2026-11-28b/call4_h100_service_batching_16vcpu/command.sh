R=/tmp/r4; source benchmarks/device_env.sh
for i in 1 2; do
  timeout 170 python3 benchmarks/bench_service.py --duration 8 --warmup 2 --prime 3 --clients 64 --max-len 256 --out $R/service_$i > $R/service_$i.log 2>&1; echo "service $i rc=$?"
  grep -E "clients +64:|^ +64 " $R/service_$i.log
  echo "at $(( $(date +%s) - S )) s"
done
cp benchmarks/_call4.sh $R/command.sh
tar czf $OUT/r4.tgz -C /tmp r4
