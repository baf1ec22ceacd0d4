#!/usr/bin/env bash
# A real single-node Slurm for the tests (tests/slurm/test_slurm.py): munged, slurmctld and slurmd on this
# machine, without systemd or cgroups (docs/performance.md, "A real Slurm on one machine"). Needs root.
#   .ci/slurm_up.sh        install if missing, write a minimal slurm.conf, start the daemons
#   .ci/slurm_up.sh down   stop the daemons this script started (by their pid files)
# Idempotent: if a controller already answers, it does nothing. It never overwrites a slurm.conf
# that it did not write itself.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# written by .ci/slurm_up.sh"
PIDS=(/run/slurm/slurmd.pid /run/slurm/slurmctld.pid /run/munge/munged.pid)
SUDO=; [[ $EUID -eq 0 ]] || SUDO=sudo

if [[ ${1:-up} == down ]]; then
  for pidfile in "${PIDS[@]}"; do
    [[ -f $pidfile ]] && $SUDO kill "$(cat "$pidfile")" 2>/dev/null && echo "stopped $(basename "$pidfile" .pid)"
  done
  exit 0
fi

if command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q ' is UP'; then
  echo "slurm: a controller already answers; nothing to do"
  exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  pkgs=(slurmctld slurmd slurm-client munge)
  # A fresh container has empty package lists: update only when the plain install fails.
  $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null; }
fi

if [[ -f $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
  echo "slurm: $CONF exists and was not written by this script; leaving it alone" >&2
  exit 1
fi

host=$(hostname -s)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))  # a bit under MemTotal
$SUDO mkdir -p /etc/slurm
$SUDO tee "$CONF" >/dev/null <<EOF
$MARK
ClusterName=ci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
# Without this a requeued job is held about 120 s before it starts again.
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
MailProg=/bin/true
# A requeued job waits for a periodic scheduler pass (defaults: 30 s and 60 s): keep the tests brisk.
SchedulerParameters=bf_interval=2,sched_interval=2
# Finished jobs stay visible to `scontrol show job` (no slurmdbd, so no sacct) for 10 minutes.
MinJobAge=600
KillWait=10
StateSaveLocation=/var/spool/slurm/ctld
SlurmdSpoolDir=/var/spool/slurm/d
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

# munge: its key comes with the package; it only needs its run directory.
$SUDO install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -f /etc/munge/munge.key ]]; then
  $SUDO mkdir -p /etc/munge
  $SUDO dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  $SUDO chown munge:munge /etc/munge/munge.key && $SUDO chmod 0400 /etc/munge/munge.key
fi
if ! { [[ -f /run/munge/munged.pid ]] && $SUDO kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; }; then
  $SUDO runuser -u munge -- /usr/sbin/munged
fi

$SUDO install -d -o slurm -g slurm /var/spool/slurm/ctld /var/log/slurm /run/slurm
$SUDO install -d /var/spool/slurm/d
for daemon in slurmctld slurmd; do
  pidfile=/run/slurm/$daemon.pid
  if ! { [[ -f $pidfile ]] && $SUDO kill -0 "$(cat "$pidfile")" 2>/dev/null; }; then
    $SUDO "/usr/sbin/$daemon"
  fi
done

for _ in $(seq 100); do
  state=$(sinfo -h -o %T 2>/dev/null || true)
  if [[ $state == idle* ]]; then
    echo "slurm: up ($host, $(nproc) CPUs, ${mem_mb} MB; $(sinfo -V))"
    exit 0
  fi
  sleep 0.2
done
echo "slurm: the node did not become idle (state '${state:-none}'); see /var/log/slurm/" >&2
exit 1
