#!/bin/bash
# A shell pipeline: a slow generator feeds GNU sort with a small buffer, so sort spills to /tmp meanwhile;
# the script keeps a log open in /tmp too and copies it into the work dir at the end.
set -euo pipefail
python=$1 steps=$2 pace_ms=$3
exec 3>>/tmp/pipeline.log
echo "started" >&3
"$python" - "$steps" "$pace_ms" <<'PY' | sort -S 1M -k2,2 -k1,1n | uniq -c -f1 > result.txt
import sys, time, hashlib
steps, pace = int(sys.argv[1]), int(sys.argv[2]) / 1000
with open("progress.log", "a") as progress:
    for step in range(steps):
        for i in range(4000):
            key = hashlib.md5(f"{step}-{i}".encode()).hexdigest()[:4]
            sys.stdout.write(f"{step * 4000 + i} {key} {'x' * 40}\n")
        sys.stdout.flush()
        progress.write(f"step {step}\n")
        progress.flush()
        time.sleep(pace)
PY
echo "sorted $(wc -l < result.txt) groups" >&3
exec 3>&-
cp /tmp/pipeline.log log.txt
