cd .scratch/wt_hp && cp ../ab_tuning.py .
P="[(16,32768,32,8,128,'4bit'),(16,131072,32,8,128,'4bit'),(8,32768,32,8,128,'4bit'),(4,32768,32,8,128,'4bit')]"
MID="'key_words':True,'meta_pairs':False,'meta_words':True,'vmid_chain':True,'bt_next':True"
V="{'base':{},'base_r168':{'maxnreg':168},'hp_r168':{'head_pairs':2,'maxnreg':168},'hp_free':{'head_pairs':2,'maxnreg':None},'mid_hp168':{$MID,'head_pairs':2,'maxnreg':168,'num_warps':4},'mid_kw':{$MID,'num_warps':4}}"
python3 ab_tuning.py "$P" "$V" 0 2>&1 | grep -v FAILED | tail -3
python3 ab_tuning.py "$P" "$V" 2 $OUT/ab_hp2.json 2>&1 | grep -v "FAILED" | tail -40
