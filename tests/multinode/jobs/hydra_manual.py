"""Node 0 of an MPICH job over several VMs: mpiexec with Hydra's manual launcher, as spotcr's launcher will be.

Usage: hydra_manual.py HOSTS MPIEXEC-ARGS...  (HOSTS: node addresses, comma-separated, node 0's first)
Runs `mpiexec -launcher manual -hosts HOSTS MPIEXEC-ARGS...`, starts the proxy Hydra asks for on node 0 here,
and writes the proxy command for node i to launch-<i>.txt in the working directory, where the agent of node i
(the test, here) takes it and runs it as that node's share of the job. Exits with mpiexec's exit code.
"""

import os
import shlex
import subprocess
import sys

hosts = sys.argv[1]
mpiexec = subprocess.Popen(
    ["mpiexec", "-launcher", "manual", "-hosts", hosts, *sys.argv[2:]], stdout=subprocess.PIPE, text=True
)
assert mpiexec.stdout is not None
proxies = []
for line in mpiexec.stdout:
    if line.startswith("HYDRA_LAUNCH_END"):
        break
    if line.startswith("HYDRA_LAUNCH: "):
        argv = shlex.split(line.removeprefix("HYDRA_LAUNCH: "))
        proxy_id = int(argv[argv.index("--proxy-id") + 1])
        if proxy_id == 0:
            proxies.append(subprocess.Popen(argv))
        else:
            with open(f"launch-{proxy_id}.txt.new", "w") as out:
                out.write(shlex.join(argv) + "\n")
            os.rename(f"launch-{proxy_id}.txt.new", f"launch-{proxy_id}.txt")
    else:
        sys.stdout.write(line)
sys.stdout.write(mpiexec.stdout.read())
code = mpiexec.wait()
for proxy in proxies:
    proxy.wait()
sys.exit(code)
