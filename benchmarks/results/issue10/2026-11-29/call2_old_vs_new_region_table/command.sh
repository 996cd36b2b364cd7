R=/tmp/r2; source benchmarks/device_env.sh
F=$(python3 -c "import attention_service.engine.regions as m; print(m.__file__)")
echo "installed: $F"
cp "$F" /tmp/new_regions.py; cp benchmarks/_old_regions.py "$F"
python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/service/test_regions_gpu.py -k "share_its_mapping or belong_to_their_token" > $R/old_server.log 2>&1; echo "old server rc=$?" | tee -a $R/old_server.log
grep -E "passed|failed|Error|details|StatusCode" $R/old_server.log | head -20
cp /tmp/new_regions.py "$F"
python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/service/test_regions_gpu.py -k "share_its_mapping or belong_to_their_token" > $R/new_server.log 2>&1; echo "new server rc=$?" | tee -a $R/new_server.log
tail -2 $R/new_server.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call2.sh $R/command.sh; tar czf $OUT/r2.tgz -C /tmp r2
