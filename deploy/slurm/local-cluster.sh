#!/usr/bin/env bash
# A two-node SLURM cluster on this one machine (munge + slurmctld + slurmd n1 + slurmd n2), for pitstop's
# tests and for trying the SLURM recipes locally. Needs root and Debian's packages:
#   apt-get install -y slurm-wlm munge
#
#   deploy/slurm/local-cluster.sh up DIR [BASE_PORT]   # brings it up; prints `export SLURM_CONF=DIR/slurm.conf`
#   eval "$(deploy/slurm/local-cluster.sh up /tmp/slurm)"; sbatch --wrap hostname; squeue
#   deploy/slurm/local-cluster.sh status DIR            # daemons, ports, sinfo, squeue; exit 0 when all are up
#   deploy/slurm/local-cluster.sh down DIR              # cancels its jobs, stops its daemons (and munged if
#                                                       # this script started it and no other cluster runs)
#
# DIR holds everything of the cluster: slurm.conf (rendered from deploy/slurm/slurm.conf.in), state, spool,
# pid files and logs (DIR/log). `up` is idempotent (a running cluster in DIR is kept as it is) and a cluster
# left running in another DIR is no obstacle: the ports are picked free, from BASE_PORT (or
# $PITSTOP_SLURM_PORT) when given, else the first free run of 3 from 16817. Each node offers
# $PITSTOP_SLURM_CPUS CPUs (default 1) and $PITSTOP_SLURM_MEM_MB MB (default: half the machine's memory).
# The node names n1/n2 must resolve for a rendezvous on `n1` (pitstop's strategy.rdzv_endpoint=slurm): when
# they do not, one line `127.0.0.1 n1 n2` is added to /etc/hosts.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TEMPLATE=${PITSTOP_SLURM_TEMPLATE:-$HERE/slurm.conf.in}
WAIT_S=${PITSTOP_SLURM_WAIT:-60}
NODES=(n1 n2)
MUNGE_SOCKET=/run/munge/munge.socket.2
MUNGE_PID=/run/munge/munged.pid

say() { echo "local-cluster: $*" >&2; }
die() { say "$*"; exit 1; }

usage() {
    sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# running PID NAME: PID is a live process called NAME (not a zombie, not a reused pid).
running() {
    local stat
    [[ $1 =~ ^[0-9]+$ ]] && stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    [[ $(cat "/proc/$1/comm" 2>/dev/null) == "$2" ]] && [[ ${stat##*) } != Z* ]]
}

# alive PIDFILE NAME: the pid file names a running process called NAME.
alive() { [[ -s $1 ]] && running "$(<"$1")" "$2"; }

# others NAME...: some process called NAME runs (another cluster's daemon).
others() {
    local name pid
    for name in "$@"; do
        for pid in $(pgrep -x "$name" || true); do running "$pid" "$name" && return 0; done
    done
    return 1
}

port_free() { [[ -z $(ss -Htln "( sport = :$1 )" 2>/dev/null) ]]; }

munge_ok() { [[ -S $MUNGE_SOCKET ]] && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

need_tools() {
    local missing=() t
    for t in slurmctld slurmd sinfo squeue scancel munged munge unmunge ss getent; do
        command -v "$t" >/dev/null 2>&1 || missing+=("$t")
    done
    ((${#missing[@]} == 0)) || die "not found: ${missing[*]} (as root: apt-get install -y slurm-wlm munge)"
    ((EUID == 0)) || die "needs root (SlurmUser=root, munged, /etc/hosts)"
}

start_munge() {  # DIR
    if munge_ok; then return 0; fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        say "creating /etc/munge/munge.key"
        install -d -o munge -g munge -m 0700 /etc/munge
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile=/etc/munge/munge.key >/dev/null
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    local d
    for d in /var/lib/munge /var/log/munge; do [[ -d $d ]] || install -d -o munge -g munge -m 0700 "$d"; done
    # As the munge user (its key, log and seed dirs are the package's); as root only where that fails.
    runuser -u munge -- munged 2>/dev/null || munged --force
    local i
    for ((i = 0; i < 50; i++)); do
        munge_ok && { echo "$1" >"$1/run/munged.ours"; return 0; }
        sleep 0.1
    done
    die "munged did not come up (see /var/log/munge/munged.log)"
}

ensure_hosts() {  # the node names resolve (a rendezvous on `n1`), added to /etc/hosts only when they do not
    local n missing=()
    for n in "${NODES[@]}"; do getent hosts "$n" >/dev/null || missing+=("$n"); done
    ((${#missing[@]} == 0)) && return 0
    if [[ -w /etc/hosts ]]; then
        say "adding '127.0.0.1 ${missing[*]}' to /etc/hosts"
        printf '127.0.0.1\t%s\t# pitstop local SLURM cluster\n' "${missing[*]}" >>/etc/hosts
    else
        say "warning: ${missing[*]} do not resolve and /etc/hosts is not writable: a rendezvous on them fails"
    fi
}

pick_ports() {  # prints CTLD N1 N2
    local base=${1:-${PITSTOP_SLURM_PORT:-}} p
    if [[ -n $base ]]; then
        for p in "$base" $((base + 1)) $((base + 2)); do port_free "$p" || die "port $p is in use (base $base)"; done
        echo "$base $((base + 1)) $((base + 2))"
        return 0
    fi
    for ((p = 16817; p < 16817 + 300; p += 3)); do
        if port_free "$p" && port_free $((p + 1)) && port_free $((p + 2)); then
            echo "$p $((p + 1)) $((p + 2))"
            return 0
        fi
    done
    die "no 3 free ports in 16817-17117; give a BASE_PORT"
}

mem_mb() {
    if [[ -n ${PITSTOP_SLURM_MEM_MB:-} ]]; then echo "$PITSTOP_SLURM_MEM_MB"; return; fi
    awk '/^MemTotal:/ {print int($2 / 1024 / 2)}' /proc/meminfo
}

any_alive() {  # DIR
    local n
    alive "$1/run/slurmctld.pid" slurmctld && return 0
    for n in "${NODES[@]}"; do alive "$1/run/slurmd-$n.pid" slurmd && return 0; done
    return 1
}

render() {  # DIR BASE_PORT
    local dir=$1 ports host
    read -r -a ports <<<"$(pick_ports "${2:-}")"
    host=$(hostname -s)
    sed -e "s|@DIR@|$dir|g" -e "s|@HOST@|$host|g" -e "s|@CTLD_PORT@|${ports[0]}|g" \
        -e "s|@N1_PORT@|${ports[1]}|g" -e "s|@N2_PORT@|${ports[2]}|g" \
        -e "s|@CPUS@|${PITSTOP_SLURM_CPUS:-1}|g" -e "s|@MEM@|$(mem_mb)|g" "$TEMPLATE" >"$dir/slurm.conf.tmp"
    mv "$dir/slurm.conf.tmp" "$dir/slurm.conf"
}

nodes_idle() {
    local out
    out=$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null) || return 1
    [[ $(grep -cE '^n[12] idle$' <<<"$out") == 2 ]]
}

up() {
    local dir=$1 n t0=$SECONDS
    need_tools
    [[ -f $TEMPLATE ]] || die "no template $TEMPLATE"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    mkdir -p "$dir"/{state,spool,run,log}
    export SLURM_CONF=$dir/slurm.conf
    start_munge "$dir"
    ensure_hosts
    if any_alive "$dir" && [[ -f $SLURM_CONF ]]; then
        say "a cluster already runs in $dir: keeping its slurm.conf"
    else
        render "$dir" "${2:-}"
    fi
    local fresh=0
    if ! alive "$dir/run/slurmctld.pid" slurmctld; then
        [[ -f $dir/log/slurmctld.log ]] && mv "$dir/log/slurmctld.log" "$dir/log/slurmctld.log.old"
        slurmctld -c
        fresh=1
    fi
    for n in "${NODES[@]}"; do
        alive "$dir/run/slurmd-$n.pid" slurmd || slurmd -N "$n"
    done
    while ! nodes_idle; do
        if ((SECONDS - t0 > WAIT_S)); then
            sinfo -N >&2 || true
            tail -n 20 "$dir"/log/*.log >&2 || true
            die "the nodes were not idle within ${WAIT_S} s (logs: $dir/log)"
        fi
        sleep 0.2
    done
    # slurmctld's first scheduling pass comes ~3 s after its start; a job submitted before it waits for it.
    while ((fresh)) && ! grep -q 'SchedulerParameters=' "$dir/log/slurmctld.log" 2>/dev/null; do
        ((SECONDS - t0 > WAIT_S)) && { say "warning: no scheduling pass yet after ${WAIT_S} s"; break; }
        sleep 0.2
    done
    say "up in $((SECONDS - t0)) s: $(sinfo -h -o '%P %a %D %t %N' | tr '\n' ' ')"
    echo "export SLURM_CONF=$SLURM_CONF"
}

stop() {  # PIDFILE NAME
    alive "$1" "$2" || { rm -f "$1"; return 0; }
    local pid i
    pid=$(<"$1")
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        alive "$1" "$2" || { rm -f "$1"; return 0; }
        sleep 0.1
    done
    say "$2 ($pid) did not stop on SIGTERM within 10 s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$1"
}

down() {
    local dir=$1 n i pid
    [[ -d $dir ]] || { say "no $dir: nothing to stop"; return 0; }
    dir=$(cd "$dir" && pwd)
    export SLURM_CONF=$dir/slurm.conf
    if alive "$dir/run/slurmctld.pid" slurmctld && [[ -n $(squeue -h -o %i 2>/dev/null) ]]; then
        scancel --full $(squeue -h -o %i) 2>/dev/null || true
        for ((i = 0; i < 150; i++)); do  # KillWait=5: SIGTERM, then SIGKILL after 5 s
            [[ -z $(squeue -h -t R,CG -o %i 2>/dev/null) ]] && break
            sleep 0.1
        done
    fi
    for n in "${NODES[@]}"; do stop "$dir/run/slurmd-$n.pid" slurmd; done
    stop "$dir/run/slurmctld.pid" slurmctld
    if [[ -f $dir/run/munged.ours ]]; then
        if others slurmctld slurmd; then
            say "leaving munged running: another SLURM daemon uses it"
        else
            stop "$MUNGE_PID" munged
        fi
        rm -f "$dir/run/munged.ours"
    fi
    say "down: $dir"
}

status() {
    local dir=$1 n rc=0
    [[ -d $dir ]] || die "no $dir"
    dir=$(cd "$dir" && pwd)
    export SLURM_CONF=$dir/slurm.conf
    if munge_ok; then echo "munged: up"; else echo "munged: DOWN"; rc=3; fi
    if alive "$dir/run/slurmctld.pid" slurmctld; then
        echo "slurmctld: up (pid $(<"$dir/run/slurmctld.pid"), $(grep -h '^SlurmctldPort=' "$SLURM_CONF"))"
    else
        echo "slurmctld: DOWN"; rc=3
    fi
    for n in "${NODES[@]}"; do
        if alive "$dir/run/slurmd-$n.pid" slurmd; then
            echo "slurmd $n: up (pid $(<"$dir/run/slurmd-$n.pid"), $(grep -ho "^NodeName=$n .*Port=[0-9]*" "$SLURM_CONF" | grep -o 'Port=[0-9]*'))"
        else
            echo "slurmd $n: DOWN"; rc=3
        fi
    done
    if ((rc == 0)); then
        sinfo -N -o '%N %P %t %c %m' || rc=3
        squeue || rc=3
        echo "export SLURM_CONF=$SLURM_CONF"
    fi
    return "$rc"
}

cmd=${1:-}
[[ $# -ge 2 ]] || usage
case $cmd in
    up) up "$2" "${3:-}" ;;
    down) down "$2" ;;
    status) status "$2" ;;
    *) usage ;;
esac
