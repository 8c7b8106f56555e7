#!/bin/bash
# What the workload suite's programs need on a fresh Debian 12 machine, from Debian's own packages;
# a tool already on PATH (say a newer Go or Node) is used as it is. `make test` runs this; a second run installs nothing.
set -euo pipefail
export PATH="/usr/local/go/bin:$PATH"
declare -A package=(
  [redis-server]=redis-server
  [mpicc]=libmpich-dev
  [mpiexec]=mpich
  [mpicc.openmpi]=libopenmpi-dev
  [mpiexec.openmpi]=openmpi-bin
  [java]=default-jre-headless
  [javac]=default-jdk-headless
  [go]=golang-go
  [node]=nodejs
  [gcc]=gcc
  [sort]=coreutils
)
missing=()
for tool in "${!package[@]}"; do
  command -v "$tool" >/dev/null || missing+=("${package[$tool]}")
done
# gcc's OpenMP runtime comes with gcc on Debian, but a gcc from elsewhere may lack it.
if command -v gcc >/dev/null && ! echo 'int main(void){return 0;}' | gcc -fopenmp -x c -o /dev/null - 2>/dev/null; then
  missing+=(libgomp1)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "workloads: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# Open MPI beside MPICH takes Debian's mpicc and mpiexec (a higher priority): they stay MPICH's, as a user of the
# one has them; the suite calls Open MPI's by their own names (mpicc.openmpi, mpiexec.openmpi).
multiarch=$(gcc -print-multiarch)
update-alternatives --set mpi /usr/bin/mpicc.mpich >/dev/null
update-alternatives --set mpirun /usr/bin/mpirun.mpich >/dev/null
update-alternatives --set "mpi-$multiarch" "/usr/include/$multiarch/mpich" >/dev/null
