source bench/device_env.sh
kw() { python3 -c "from pallas_kernels.indexer import gpu; import json; print(json.dumps(gpu.FAST['$1']))"; }
for n in sp64_kq_s6_pf_qi_1w_f8 sp64_kq_s8_pf_qi_1w_f8 sp64_kq_s6_pf_qi_f8 sp128_kq_s6_pf_qi_1w_f8; do
  echo "== 32K $n"; timeout 50 python3 bench/dsa_profile.py --ops indexer --ctx 32768 --ix-kw "$(kw $n)" --time 2>&1 | grep "per call" ; done
timeout 330 python3 bench/dsa.py --batches 32 --heads 12 --contexts 32768,131072,1048576 --only sp64_kq_s6_pf_qi_1w_f8,sp64_kq_s8_pf_qi_1w_f8,sp256_kq_s5_pf_qi_1w_f8,sp256_kq_w8_s5_pf_qi_1w_f8,sp128_qk_s5_pf_qi_1w,sr16_bk32_s5_qi_ns8 --budget 310 2>&1 | grep -E "tuning_indexer|^indexer ctx|indexer score kernel|FAIL|rror" | grep -v mxfp4 | cut -c1-1200 | tail -12
