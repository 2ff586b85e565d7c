#!/bin/bash
# Review reproductions: share_graph with a static cache. Each line PASS or FAIL.
cd "$(dirname "$0")"
timeout 200 bash -c '
python3 custom_modules.py 2>&1 | grep -E "^(PASS|FAIL|INFO)|Error" 
python3 hf_llama.py all 2>&1 | grep -E "^(PASS|FAIL|INFO)|Error"
' || echo "FAIL run_all timed out or crashed (rc=$?)"
