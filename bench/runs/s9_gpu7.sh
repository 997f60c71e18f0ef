source bench/device_env.sh
timeout 190 python3 bench/dsa.py --batches 32 --heads 12 --contexts 32768 --ix-storage --no-tune --budget 180 2>&1 | grep -E "^indexer ctx|indexer score kernel|DSA bench" | grep -v mxfp4 | cut -c1-500 | tail -5
