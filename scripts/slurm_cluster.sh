#!/usr/bin/env bash
# A real, single-node SLURM cluster on this machine, from Debian's slurm-wlm and munge.
#
#   scripts/slurm_cluster.sh start    # munged + slurmctld + slurmd; waits until the node is idle
#   scripts/slurm_cluster.sh status   # sinfo / squeue
#   scripts/slurm_cluster.sh stop     # cancel every job, shut the daemons down, leave nothing running
#   scripts/slurm_cluster.sh restart
#
# Needs root and the Debian packages `slurm-wlm` and `munge` (slurmctld, slurmd, slurm-client).
# Idempotent: `start` on a running cluster with an unchanged config does nothing; with a changed
# config it restarts the daemons. All SLURM traffic goes to 127.0.0.1 (NodeAddr/SlurmctldHost).
#
# Environment knobs (all optional):
#   SLURM_CLUSTER_CPUS       CPUs the node advertises. Default max(4, nproc): on a 2-core box two
#                            2-rank jobs (a 2-point sweep) run side by side and a 4-rank job fits.
#                            Set it to $(nproc) for a strict, non-oversubscribed node.
#   SLURM_CLUSTER_PARTITION  partition name (default: debug)
#   SLURM_CLUSTER_NAME       ClusterName (default: sparsetrain)
#   SLURM_CLUSTER_TIMEOUT    seconds to wait for the node to become idle (default: 60)
set -euo pipefail

PARTITION="${SLURM_CLUSTER_PARTITION:-debug}"
CLUSTER_NAME="${SLURM_CLUSTER_NAME:-sparsetrain}"
TIMEOUT="${SLURM_CLUSTER_TIMEOUT:-60}"

CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
CTLD_SPOOL=/var/spool/slurmctld
SLURMD_SPOOL=/var/spool/slurmd
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm
CTLD_PID="$RUN_DIR/slurmctld.pid"
SLURMD_PID="$RUN_DIR/slurmd.pid"
MUNGE_KEY=/etc/munge/munge.key
MUNGE_RUN=/run/munge
MUNGE_PID="$MUNGE_RUN/munged.pid"
SLURM_USER=slurm

log() { echo "[slurm_cluster] $*" >&2; }
die() { echo "[slurm_cluster] ERROR: $*" >&2; exit 1; }

need_root() { [[ $EUID -eq 0 ]] || die "must run as root (it writes /etc/slurm and starts daemons)"; }

need_bins() {
    local b missing=()
    for b in munged munge unmunge slurmctld slurmd sinfo srun scontrol squeue scancel; do
        command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] || missing+=("$b")
    done
    ((${#missing[@]} == 0)) || die "missing ${missing[*]}; install with: apt-get install -y slurm-wlm munge"
}

pid_alive() { # pidfile [expected comm]
    local f=$1 comm=${2:-} pid
    [[ -s $f ]] || return 1
    pid=$(<"$f")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
    # A killed daemon can linger as a zombie until init reaps it: that is not running.
    [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]] || return 1
    [[ -z $comm || "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$comm" ]]
}

tail_logs() {
    local f
    for f in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" /var/log/munge/munged.log; do
        [[ -f $f ]] && { echo "---- tail $f" >&2; tail -n 25 "$f" >&2; }
    done
    return 0
}

# ---------------------------------------------------------------------------------------- munge
start_munge() {
    if [[ ! -s $MUNGE_KEY ]]; then
        log "creating $MUNGE_KEY"
        install -d -o munge -g munge -m 0700 /etc/munge
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile="$MUNGE_KEY" --force
        else
            dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none
        fi
    fi
    chown munge:munge "$MUNGE_KEY"
    chmod 0400 "$MUNGE_KEY"
    install -d -o munge -g munge -m 0755 "$MUNGE_RUN"
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    if pid_alive "$MUNGE_PID" munged && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    log "starting munged"
    rm -f "$MUNGE_RUN/munge.socket.2" "$MUNGE_RUN/munge.socket.2.lock" "$MUNGE_PID"
    runuser -u munge -- /usr/sbin/munged --force \
        || { tail_logs; die "munged failed to start"; }
    local i
    for ((i = 0; i < 50; i++)); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    tail_logs
    die "munge does not answer (munge -n | unmunge fails)"
}

stop_munge() {
    pid_alive "$MUNGE_PID" munged || return 0
    local pid; pid=$(<"$MUNGE_PID")
    log "stopping munged (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    wait_gone "$pid" 10 || kill -KILL "$pid" 2>/dev/null || true
}

# ---------------------------------------------------------------------------------------- config
node_cpus() {
    local n; n=$(nproc)
    if [[ -n ${SLURM_CLUSTER_CPUS:-} ]]; then echo "$SLURM_CLUSTER_CPUS"; return; fi
    ((n < 4)) && n=4
    echo "$n"
}

real_memory_mb() {
    # slurmd -C reports what slurmd itself will detect; fall back to /proc/meminfo.
    local m
    m=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n1)
    [[ -n $m ]] || m=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    # Leave a little headroom so a small rounding difference never drains the node.
    echo $((m * 95 / 100))
}

write_conf() { # prints the config to stdout
    local host cpus mem overrides=""
    host=$(hostname -s)
    cpus=$(node_cpus)
    mem=$(real_memory_mb)
    # Advertising more CPUs than the hardware has needs config_overrides, or slurmd drains the node.
    ((cpus != $(nproc))) && overrides="SlurmdParameters=config_overrides"
    cat <<EOF
# Written by scripts/slurm_cluster.sh (sparsetrain). A single-node test cluster; edits are overwritten.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$host(127.0.0.1)
AuthType=auth/munge
CredType=cred/munge
SlurmUser=$SLURM_USER
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$CTLD_SPOOL
SlurmdSpoolDir=$SLURMD_SPOOL
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
MailProg=/bin/true
InactiveLimit=0
KillWait=10
MinJobAge=300
SlurmctldTimeout=60
SlurmdTimeout=120
$overrides
NodeName=$host NodeAddr=127.0.0.1 NodeHostname=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

prepare_dirs() {
    install -d -m 0755 "$CONF_DIR"
    install -d -o "$SLURM_USER" -g "$SLURM_USER" -m 0755 "$CTLD_SPOOL" "$LOG_DIR" "$RUN_DIR"
    install -d -o root -g root -m 0755 "$SLURMD_SPOOL"
    touch "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log"
    chown "$SLURM_USER:$SLURM_USER" "$LOG_DIR/slurmctld.log"
    # cgroup.conf is not used (proctrack/linuxproc, task/none), but slurmd warns if it is missing.
    [[ -f $CONF_DIR/cgroup.conf ]] || echo "# not used: proctrack/linuxproc, task/none" >"$CONF_DIR/cgroup.conf"
}

# ---------------------------------------------------------------------------------------- daemons
wait_gone() { # pid seconds
    local pid=$1 t=$2 i
    for ((i = 0; i < t * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    return 1
}

daemons_running() { pid_alive "$CTLD_PID" slurmctld && pid_alive "$SLURMD_PID" slurmd; }

node_state() { sinfo -h -N -o '%T' 2>/dev/null | head -n1; }

wait_idle() {
    local i state=""
    for ((i = 0; i < TIMEOUT * 2; i++)); do
        state=$(node_state || true)
        case $state in
            idle | mixed | allocated | completing) return 0 ;;
            drain* | down*)
                # A previous unclean stop can leave the node down; bring it back once.
                scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 0.5
    done
    echo "[slurm_cluster] ERROR: node not idle after ${TIMEOUT}s (state: '${state:-no answer}')" >&2
    scontrol show node 2>&1 | sed 's/^/    /' >&2 || true
    tail_logs
    return 1
}

start() {
    need_root
    need_bins
    start_munge
    prepare_dirs
    local new; new=$(write_conf)
    if daemons_running && [[ -f $CONF ]] && [[ "$(<"$CONF")" == "$new" ]]; then
        log "already running"
        wait_idle || exit 1
        status_brief
        return 0
    fi
    local ctld_flags=-i
    if [[ -s $CTLD_PID ]] && ! pid_alive "$CTLD_PID" slurmctld; then
        # slurmctld died without a clean shutdown: its saved state can hold ghost jobs (finished,
        # but recorded as running). This is a test cluster, so start from a clean state.
        log "slurmctld was not shut down cleanly: clearing its saved state (-c)"
        ctld_flags=-c
    fi
    if daemons_running || pid_alive "$CTLD_PID" || pid_alive "$SLURMD_PID"; then
        log "config changed or a daemon is missing: restarting"
        stop_daemons
    fi
    printf '%s\n' "$new" >"$CONF"
    chmod 0644 "$CONF"
    log "wrote $CONF ($(hostname -s), CPUs=$(node_cpus), partition $PARTITION)"
    log "starting slurmctld"
    # -i: ignore unreadable state files instead of refusing to start; -c: after a crash, see above.
    slurmctld "$ctld_flags" || { tail_logs; die "slurmctld failed to start"; }
    log "starting slurmd"
    slurmd || { tail_logs; die "slurmd failed to start"; }
    wait_idle || exit 1
    status_brief
}

stop_daemons() {
    local ids pid i grace=0
    if pid_alive "$CTLD_PID" slurmctld; then
        grace=15  # scontrol shutdown below stops slurmctld and slurmd
        ids=$(squeue -h -o '%A' 2>/dev/null || true)
        if [[ -n $ids ]]; then
            log "cancelling jobs: $(echo $ids)"
            # shellcheck disable=SC2086
            scancel $ids 2>/dev/null || true
            for ((i = 0; i < 60; i++)); do
                [[ -z "$(squeue -h -o '%A' 2>/dev/null)" ]] && break
                sleep 0.5
            done
        fi
        scontrol shutdown >/dev/null 2>&1 || true
    fi
    for f in "$SLURMD_PID:slurmd" "$CTLD_PID:slurmctld"; do
        if pid_alive "${f%%:*}" "${f##*:}"; then
            pid=$(<"${f%%:*}")
            wait_gone "$pid" "$grace" || {
                log "${f##*:} (pid $pid) still alive: SIGTERM"
                kill -TERM "$pid" 2>/dev/null || true
                wait_gone "$pid" 10 || kill -KILL "$pid" 2>/dev/null || true
            }
        fi
    done
    # Job steps that outlived slurmd (only possible after a crash): end them by pid.
    for pid in $(pgrep -x slurmstepd 2>/dev/null || true); do
        log "leftover slurmstepd pid $pid: SIGTERM"
        kill -TERM "$pid" 2>/dev/null || true
    done
    rm -f "$CTLD_PID" "$SLURMD_PID"
}

stop() {
    need_root
    stop_daemons
    stop_munge
    log "stopped"
}

status_brief() { sinfo; }

status() {
    if ! sinfo >/dev/null 2>&1; then
        echo "SLURM cluster: not running (sinfo does not answer)"
        return 3
    fi
    sinfo
    echo
    squeue
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    restart) stop; start ;;
    status) status ;;
    config) write_conf ;;
    *) echo "usage: $0 {start|stop|restart|status|config}" >&2; exit 2 ;;
esac
