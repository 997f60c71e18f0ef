source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -q -m gpu tests/test_dsa_kernels.py -k "fp8_dots" --tb=short 2>&1 | grep -v "Warning\|return rule" | tail -8 )
kw() { python3 -c "from pallas_kernels.indexer import gpu; import json; print(json.dumps(gpu.FAST['$1']))"; }
for n in sp128_qk_s5_pf_qi_1w sp256_kq_s5_pf_qi_1w_f8 sp256_kq_s5_pf_qi_f8 sp256_kq_w8_s5_pf_qi_1w_f8 sp256_kq_s4_pf_qi_1w_f8 sp128_kq_s5_pf_qi_3w_f8 sp128_kq_s5_pf_qi_f8 sp64_kq_s6_pf_qi_1w_f8; do
  echo "== 32K $n"; timeout 60 python3 bench/dsa_profile.py --ops indexer --ctx 32768 --ix-kw "$(kw $n)" --time 2>&1 | grep "per call" ; done
for n in sp256_kq_s5_pf_qi_1w_f8 sp256_kq_w8_s5_pf_qi_1w_f8 sp256_kq_s5_pf_qi_f8; do
  echo "== 128K $n"; timeout 80 python3 bench/dsa_profile.py --ops indexer --ctx 131072 --ix-kw "$(kw $n)" --time 2>&1 | grep "per call" ; done
