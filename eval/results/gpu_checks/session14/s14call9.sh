export PYTHONUNBUFFERED=1
P="[(16,32768,32,8,128,'4bit'),(1,32768,32,8,128,'4bit'),(4,32768,32,8,128,'4bit')]"
V="{'default':{},'ns2':{'num_stages':2},'bn64':{'block_n':64},'bn64ns2':{'block_n':64,'num_stages':2}}"
python3 .scratch/ab_tuning.py "$P" "$V" 0 2>&1 | grep -i fail | head -5
python3 .scratch/ab_tuning.py "$P" "$V" 2 $OUT/ab_occupancy.json 2>&1 | grep ms
