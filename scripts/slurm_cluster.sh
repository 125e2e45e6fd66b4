#!/usr/bin/env bash
# scripts/slurm_cluster.sh start|stop|env|status
#
# A single-node Slurm cluster on this machine, from scratch, for trying and testing sweeps through
# the real sbatch/squeue/sacct/scancel: slurmctld and slurmd (proctrack/linuxproc, task/none: no
# cgroups), one partition `debug` holding this node with the CPUs and memory `slurmd -C` finds, and
# slurmdbd over a private MariaDB so that sacct answers (submitit polls job states with sacct). Every
# daemon runs as root on its own free port (munged on its own socket), with every file in one
# directory: CLUSTER_DIR (default /tmp/attention-harness-slurm). A system-wide Slurm or munge
# configuration (/etc/slurm, /etc/munge) is never read or changed; only the commands of the
# Debian packages are used.
#
#   start   installs the packages if missing (root: apt-get), writes the configuration, starts the
#           daemons, waits until the node is idle; prints the environment lines of `env`. Starting a
#           running cluster does nothing. Exit 3: the packages are missing and cannot be installed.
#   stop    cancels the cluster's jobs, stops its daemons and removes CLUSTER_DIR.
#   env     the lines that point Slurm's commands at the cluster:
#               eval "$(scripts/slurm_cluster.sh env)"; sinfo; scripts/sweep.sh cpu_small \
#                   hydra/launcher=slurm hydra.launcher.partition=debug hydra.launcher.gpus_per_node=null ...
#   status  exit 0 when the cluster is up (its node answers sinfo), 1 otherwise.
#
# Environment: CLUSTER_DIR (the directory), SLURM_CLUSTER_NO_INSTALL=1 (never run apt-get).
set -euo pipefail

CLUSTER_DIR="${CLUSTER_DIR:-/tmp/attention-harness-slurm}"
CLUSTER_DIR="${CLUSTER_DIR%/}"
CONF="$CLUSTER_DIR/etc/slurm.conf"
PARTITION=debug
CLUSTER_NAME=harness
# Debian 12 packages: the daemons, the client commands, munge, the accounting daemon and its database.
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server-core)
COMMANDS=(slurmctld slurmd slurmdbd sbatch sinfo sacct sacctmgr munged mungekey mariadbd)
DAEMONS=(slurmd slurmctld slurmdbd mariadbd munged)  # the order they stop in

say() { echo "slurm_cluster: $*" >&2; }

ours() {  # CLUSTER_DIR is missing, empty, or one this script made: safe to remove
    [ ! -e "$CLUSTER_DIR" ] || [ -z "$(ls -A "$CLUSTER_DIR" 2> /dev/null)" ] ||
        head -n 1 "$CONF" 2> /dev/null | grep -q "(scripts/slurm_cluster.sh)"
}

remove_dir() {
    if ours; then
        rm -rf "$CLUSTER_DIR"
    else
        say "$CLUSTER_DIR is not a cluster directory of this script; left as it is"
        exit 2
    fi
}

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
}

env_lines() {
    echo "export SLURM_CONF=$(printf %q "$CONF")"
}

missing_commands() {
    local c out=()
    for c in "${COMMANDS[@]}"; do
        PATH="$PATH:/usr/sbin:/sbin" command -v "$c" > /dev/null 2>&1 || out+=("$c")
    done
    echo "${out[*]}"
}

install_packages() {
    local missing
    missing="$(missing_commands)"
    [ -z "$missing" ] && return 0
    if [ "${SLURM_CLUSTER_NO_INSTALL:-0}" = 1 ]; then
        say "missing commands ($missing) and SLURM_CLUSTER_NO_INSTALL=1; install: apt-get install ${PACKAGES[*]}"
        exit 3
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
        say "missing commands ($missing); as root on Debian/Ubuntu: apt-get install ${PACKAGES[*]}"
        exit 3
    fi
    say "installing ${PACKAGES[*]} (apt-get)"
    # The packages' own services are not started (no runlevel in a container; policy-rc.d where present).
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -q > "${TMPDIR:-/tmp}/slurm_cluster-apt.log" 2>&1 &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=300 "${PACKAGES[@]}" \
               >> "${TMPDIR:-/tmp}/slurm_cluster-apt.log" 2>&1; }; then
        say "apt-get could not install ${PACKAGES[*]}: $(tail -n 1 "${TMPDIR:-/tmp}/slurm_cluster-apt.log")"
        exit 3
    fi
    missing="$(missing_commands)"
    if [ -n "$missing" ]; then
        say "still missing after apt-get: $missing"
        exit 3
    fi
}

free_ports() {  # N distinct TCP ports free on 127.0.0.1 now
    python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

pid_of() {  # the live pid in CLUSTER_DIR/run/NAME.pid, or nothing
    local f="$CLUSTER_DIR/run/$1.pid" pid
    [ -f "$f" ] || return 0
    pid="$(tr -dc 0-9 < "$f")"
    [ -n "$pid" ] && kill -0 "$pid" 2> /dev/null && echo "$pid"
    return 0
}

node_state() {
    [ -f "$CONF" ] || return 0
    SLURM_CONF="$CONF" timeout 10 sinfo -h -N -o %T 2> /dev/null | head -n 1 || true
}

is_up() {
    local state
    state="$(node_state)"
    [ "$state" = idle ] || [ "$state" = mixed ] || [ "$state" = allocated ]
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...: until the command succeeds
    local limit="$1" what="$2" start=$SECONDS
    shift 2
    until "$@" > /dev/null 2>&1; do
        if [ $((SECONDS - start)) -ge "$limit" ]; then
            say "$what did not come up within ${limit}s; logs in $CLUSTER_DIR/log:"
            tail -n 5 "$CLUSTER_DIR"/log/*.log >&2 2> /dev/null || true
            return 1
        fi
        sleep 0.2
    done
}

any_alive() {  # any_alive PID...: whether one of them still runs
    local pid
    for pid in "$@"; do
        kill -0 "$pid" 2> /dev/null && return 0
    done
    return 1
}

stop_daemons() {
    local name pid jobs pids=() start=$SECONDS
    if [ -f "$CONF" ] && [ -n "$(pid_of slurmctld)" ]; then
        # Jobs first: their processes are not the daemons' children and would outlive them. A cancelled
        # job gets SIGTERM, then SIGKILL KillWait (5) seconds later.
        jobs="$(SLURM_CONF="$CONF" timeout 10 squeue -h -o %A 2> /dev/null | sort -u || true)"
        [ -n "$jobs" ] && SLURM_CONF="$CONF" timeout 10 scancel $jobs > /dev/null 2>&1 || true
        while [ -n "$jobs" ] && [ $((SECONDS - start)) -lt 15 ]; do
            sleep 0.2
            jobs="$(SLURM_CONF="$CONF" timeout 10 squeue -h -o %A 2> /dev/null || true)"
        done
    fi
    # Then every daemon at once (one after another takes 10 s; nothing of the cluster is kept).
    for name in "${DAEMONS[@]}"; do
        pid="$(pid_of "$name")"
        [ -n "$pid" ] || continue
        pids+=("$pid")
        kill -TERM "$pid" 2> /dev/null || true
    done
    start=$SECONDS
    while [ ${#pids[@]} -gt 0 ] && any_alive "${pids[@]}" && [ $((SECONDS - start)) -lt 10 ]; do
        sleep 0.2
    done
    for pid in ${pids[@]+"${pids[@]}"}; do
        kill -KILL "$pid" 2> /dev/null || true
    done
}

write_config() {
    local node ports slurmctld_port slurmd_port dbd_port db_port facts
    node="$(uname -n)"
    node="${node%%.*}"
    read -r slurmctld_port slurmd_port dbd_port db_port <<< "$(free_ports 4)"
    # Sockets, cores, threads and memory as slurmd itself sees them (it drains a node configured larger).
    facts="$(slurmd -C | head -n 1 | tr ' ' '\n' | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore|RealMemory)=' | tr '\n' ' ')"
    mkdir -p "$CLUSTER_DIR"/{etc,run,log,munge,db,spool/slurmctld,spool/slurmd}
    chmod 711 "$CLUSTER_DIR" "$CLUSTER_DIR/munge"  # munged: clients must reach its socket
    cat > "$CONF" <<EOF
# A single-node cluster for tests (scripts/slurm_cluster.sh); no cgroups, no GPUs.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$slurmctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$CLUSTER_DIR/munge/munge.sock
StateSaveLocation=$CLUSTER_DIR/spool/slurmctld
SlurmdSpoolDir=$CLUSTER_DIR/spool/slurmd
SlurmctldPidFile=$CLUSTER_DIR/run/slurmctld.pid
SlurmdPidFile=$CLUSTER_DIR/run/slurmd.pid
SlurmctldLogFile=$CLUSTER_DIR/log/slurmctld.log
SlurmdLogFile=$CLUSTER_DIR/log/slurmd.log
PlugStackConfig=$CLUSTER_DIR/etc/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$dbd_port
AccountingStoragePass=$CLUSTER_DIR/munge/munge.sock
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
# A cancelled job's processes get SIGTERM, then SIGKILL KillWait seconds later.
KillWait=5
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$node NodeAddr=127.0.0.1 ${facts}State=UNKNOWN
PartitionName=$PARTITION Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
    : > "$CLUSTER_DIR/etc/plugstack.conf"
    # slurmdbd.conf: next to slurm.conf (slurmdbd finds it through SLURM_CONF), mode 600, its own log.
    cat > "$CLUSTER_DIR/etc/slurmdbd.conf" <<EOF
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$dbd_port
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$CLUSTER_DIR/munge/munge.sock
PidFile=$CLUSTER_DIR/run/slurmdbd.pid
LogFile=$CLUSTER_DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=root
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$CLUSTER_DIR/etc/slurmdbd.conf"
    echo "$db_port" > "$CLUSTER_DIR/etc/db.port"
}

start() {
    if is_up; then
        say "already up ($CLUSTER_DIR)"
        env_lines
        return 0
    fi
    install_packages
    [ "$(id -u)" = 0 ] || { say "needs root (the daemons run as root; slurmd starts each job as its user)"; exit 3; }
    if [ -e "$CLUSTER_DIR" ]; then  # a cluster that is down or half up: from scratch
        ours || { say "$CLUSTER_DIR exists and is not a cluster directory of this script; set CLUSTER_DIR"; exit 2; }
        stop_daemons
        remove_dir
    fi
    # A start that fails stops what it started (the logs stay in CLUSTER_DIR/log; `stop` removes them).
    trap 'stop_daemons' ERR
    write_config
    export SLURM_CONF="$CONF"
    PATH="$PATH:/usr/sbin:/sbin"
    local d="$CLUSTER_DIR"

    # munge: a fresh key, a daemon on its own socket.
    mungekey --create --keyfile="$d/munge/munge.key" > /dev/null 2>&1 ||
        dd if=/dev/urandom of="$d/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$d/munge/munge.key"
    munged --socket="$d/munge/munge.sock" --key-file="$d/munge/munge.key" --pid-file="$d/run/munged.pid" \
        --log-file="$d/log/munged.log" --seed-file="$d/munge/munged.seed" --force
    wait_for 10 munged test -S "$d/munge/munge.sock"

    # MariaDB for slurmdbd: an empty data directory, no grant tables (it listens on 127.0.0.1 only,
    # on a free port, and lives as long as the cluster).
    setsid mariadbd --no-defaults --datadir="$d/db" --socket="$d/run/mysqld.sock" --port="$(cat "$d/etc/db.port")" \
        --bind-address=127.0.0.1 --skip-grant-tables --skip-log-bin --user=root --pid-file="$d/run/mariadbd.pid" \
        --log-error="$d/log/mariadbd.log" --innodb-buffer-pool-size=16M > /dev/null 2>&1 < /dev/null &
    wait_for 30 mariadbd test -S "$d/run/mysqld.sock"

    slurmdbd
    wait_for 30 slurmdbd sacctmgr -n list cluster
    sacctmgr -i -Q add cluster "$CLUSTER_NAME" > /dev/null

    slurmctld
    wait_for 30 slurmctld scontrol ping
    slurmd -N "$(awk -F'[= ]' '/^NodeName=/{print $2}' "$CONF")"
    wait_for 60 "the node (idle)" is_up
    trap - ERR
    say "up: partition $PARTITION, $(SLURM_CONF="$CONF" sinfo -h -N -o '%N %c CPUs %m MB')"
    env_lines
}

ALLOWED="allowed: start, stop, env, status; see --help"
case "${1:-}" in
    start) start ;;
    stop)
        ours || { say "$CLUSTER_DIR is not a cluster directory of this script; nothing stopped"; exit 2; }
        stop_daemons
        remove_dir
        ;;
    env) env_lines ;;
    status) is_up ;;
    -h | --help) usage ;;
    "") say "missing command; $ALLOWED"; exit 2 ;;
    *) say "unknown command '$1'; $ALLOWED"; exit 2 ;;
esac
