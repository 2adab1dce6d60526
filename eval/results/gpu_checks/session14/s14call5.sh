export PYTHONUNBUFFERED=1
P="[(16,32768,32,8,128,'4bit'),(16,131072,32,8,128,'4bit'),(8,32768,32,8,128,'4bit'),(4,32768,32,8,128,'4bit')]"
(cd .scratch/wt_hp && python3 ../ab_tuning.py "$P" "{'main':{}}" 0 > /tmp/w1.log 2>&1) &
(cd .scratch/wt_kb && python3 ../ab_tuning.py "$P" "{'bytes':{}}" 0 > /tmp/w2.log 2>&1) &
wait
for r in 1 2; do
  (cd .scratch/wt_hp && python3 ../ab_tuning.py "$P" "{'main':{}}" 1 $OUT/main_$r.json 2>&1 | grep ms)
  (cd .scratch/wt_kb && python3 ../ab_tuning.py "$P" "{'bytes':{}}" 1 $OUT/bytes_$r.json 2>&1 | grep ms)
done
cd .scratch/wt_kb && timeout 230 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 200 2>&1 | tail -12
