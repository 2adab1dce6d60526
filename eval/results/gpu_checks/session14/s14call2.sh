cd .scratch/wt_ka && cp ../ab_levers.py .
timeout 200 python3 -m pytest -m gpu tests -q -n 10 -p no:cacheprovider -rfE --tb=short --timeout 180 2>&1 | tail -8
python3 ab_levers.py "[(16,32768),(1,32768)]" "{'bytes':{'key_words':False},'kw':{}}" 3 $OUT/ab_levers.json 2>&1 | tail -20
