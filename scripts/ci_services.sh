#!/usr/bin/env bash
# The services labkit's launcher tests need, on a fresh Debian machine, as root (what CI is).
#
#   bash scripts/ci_services.sh start    # install (first time ~15 s) and start munge + Slurm
#   bash scripts/ci_services.sh stop     # cancel every job, stop slurmd, slurmctld and munged
#   bash scripts/ci_services.sh status
#
# start installs Debian's slurmctld, slurmd, slurm-client, munge, openmpi-bin and openssh-server
# (skipped when already there), writes a one-node Slurm config for this machine and starts the
# daemons by hand (no systemd). Both commands are idempotent. The SSH test starts its own sshd
# on 127.0.0.1 from a temporary folder, and mpirun needs no daemon, so nothing else runs here.
#
# The Slurm config is for a test machine only: cgroup-free plugins (proctrack/linuxproc,
# task/none), no accounting, and the node's CPU count overridden (SlurmdParameters=
# config_overrides, CPUs=8) so that 2–4 single-CPU tasks run on a 2-core machine instead of
# pending forever. It refuses to replace an /etc/slurm/slurm.conf it did not write.
set -euo pipefail

STATE=/var/lib/labkit-slurm
LOGS=/var/log/labkit-slurm
CONF=/etc/slurm/slurm.conf
MARK="# written by labkit scripts/ci_services.sh"
PACKAGES=(slurmctld slurmd slurm-client munge openmpi-bin openssh-server openssh-client)

say() { echo "ci_services: $*"; }

need_root() {
  [ "$(id -u)" = 0 ] || { say "needs root (it installs packages and starts daemons)"; exit 1; }
}

alive() {  # alive PIDFILE: the process in PIDFILE is running
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} = 0 ] && return
  say "installing ${missing[*]}"
  # Keep the packages' own init scripts from starting daemons with their default configs.
  local policy=/usr/sbin/policy-rc.d added=""
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; added=1; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ -n "$added" ] && rm -f "$policy"
  return 0
}

write_slurm_conf() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    say "$CONF exists and is not labkit's: leaving Slurm alone"; return 1
  fi
  local host; host=$(hostname -s)
  mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$LOGS"
  cat > "$CONF" <<EOF
$MARK (a one-node test cluster; not for production)
ClusterName=labkit
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# No cgroups: plain process tracking, no task binding, no accounting.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=/run/labkit-slurmctld.pid
SlurmdPidFile=/run/labkit-slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
ReturnToService=2
KillWait=5
# Pretend to have 8 CPUs whatever the machine has, so 2-4 engine tasks fit on 2 cores.
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  alive /run/munge/munged.pid && return
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  [ -f /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null;
                                   chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key; }
  runuser -u munge -- /usr/sbin/munged
}

start_slurm() {
  write_slurm_conf || return 0
  alive /run/labkit-slurmctld.pid || slurmctld -c
  alive /run/labkit-slurmd.pid || slurmd
  local i state=""
  for i in $(seq 1 60); do       # up to 15 s for the node to report in
    state=$(sinfo -h -N -o %T 2>/dev/null | head -1 || true)
    case "$state" in idle*|mixed*|allocated*) say "slurm up (node $state)"; return 0 ;; esac
    sleep 0.25
  done
  say "slurm did not come up (node state '${state:-none}'); see $LOGS"
  tail -5 "$LOGS"/*.log 2>/dev/null || true
  return 1
}

stop_pid() {  # stop_pid PIDFILE NAME: TERM, wait up to 5 s, then KILL
  alive "$1" || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
  rm -f "$1"
  say "stopped $2"
}

stop_all() {
  if alive /run/labkit-slurmctld.pid; then
    local jobs; jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      say "cancelling jobs: $(echo $jobs)"
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 1 40); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.25; done
    fi
  fi
  stop_pid /run/labkit-slurmd.pid slurmd
  stop_pid /run/labkit-slurmctld.pid slurmctld
  stop_pid /run/munge/munged.pid munged
}

case "${1:-start}" in
  start)
    need_root
    t0=$SECONDS
    install_packages
    mkdir -p /run/sshd            # sshd refuses to start without its privilege-separation dir
    start_munge
    start_slurm
    say "ready in $((SECONDS - t0)) s (slurm, mpirun $(mpirun --version 2>/dev/null | head -1 | awk '{print $NF}'), sshd)"
    ;;
  stop)
    need_root
    stop_all
    ;;
  status)
    for f in /run/munge/munged.pid /run/labkit-slurmctld.pid /run/labkit-slurmd.pid; do
      if alive "$f"; then echo "running  $f"; else echo "stopped  $f"; fi
    done
    sinfo 2>/dev/null || true
    ;;
  *)
    echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
