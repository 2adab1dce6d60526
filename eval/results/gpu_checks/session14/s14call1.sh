set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
cd .scratch/wt_ka && cp ../ab_tuning.py . 
P1="[(16,32768,32,8,128,'4bit'),(1,32768,32,8,128,'4bit'),(4,32768,32,8,128,'4bit'),(16,131072,32,8,128,'4bit')]"
V="{'base':{},'kw':{'key_words':True}}"
python3 ab_tuning.py "$P1" "$V" 0 2>&1 | tail -3
python3 ab_tuning.py "$P1" "$V" 3 $OUT/ab_kw.json 2>&1 | tail -30
