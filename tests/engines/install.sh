#!/usr/bin/env bash
# Installs the engines the `engines` tests start for real, from Debian's packages, when they are missing:
# openssh-server (the ssh launcher), openmpi-bin (mpirun), slurm-wlm + munge (a one-node Slurm cluster).
# Needs root and apt-get; without them it says so and exits 0, and those tests skip with the reason.
set -uo pipefail
need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null || need+=(openssh-client)
command -v mpirun >/dev/null || need+=(openmpi-bin)
{ command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null; } || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
if [ ${#need[@]} -eq 0 ]; then
  echo "engines: all installed"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "engines: cannot install ${need[*]} (needs root and apt-get); their tests will skip"
  exit 0
fi
echo "engines: installing ${need[*]}"
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
timeout 240 apt-get update -qq >/dev/null || echo "engines: apt-get update failed"
if ! timeout 300 apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; then
  echo "engines: apt-get install ${need[*]} failed; their tests will skip"
fi
echo "engines: setup took $(( $(date +%s) - start )) s"
exit 0
