cd .scratch/wt_hp && cp ../ab_tuning.py .
P="[(16,32768,32,8,128,'4bit'),(16,131072,32,8,128,'4bit'),(8,32768,32,8,128,'4bit'),(4,32768,32,8,128,'4bit'),(1,32768,32,8,128,'4bit')]"
V="{'base':{},'hp3':{'head_pairs':2},'hp2':{'head_pairs':2,'num_stages':2},'hp3r168':{'head_pairs':2,'maxnreg':168},'kw_hp2':{'key_words':True,'head_pairs':2,'num_stages':2},'kw_hp3':{'key_words':True,'head_pairs':2}}"
python3 ab_tuning.py "$P" "$V" 0 2>&1 | grep -v FAILED | tail -3
python3 ab_tuning.py "$P" "$V" 2 $OUT/ab_hp.json 2>&1 | grep -v "FAILED" | tail -40
