source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mixed_tile or decode_on_device" --tb=line 2>&1 | grep -v "Warning\|warn\|return rule\|^tests/" | tail -5 )
timeout 150 python3 bench/moe.py --sweep --no-ep --budget 110 2>&1 | grep -E "bf16|dense|grouped_mm|ragged|FAIL|rror" | grep -vi warn | cut -c1-300 | head -24
