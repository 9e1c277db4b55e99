#!/usr/bin/env bash
# A real Slurm 22.05 on one machine, for tests and for trying the sbatch scripts: munged,
# MariaDB + slurmdbd (submitit needs sacct to see a job that died without a result), slurmctld
# and one slurmd per virtual node n1..n8, all as plain background processes (no systemd).
# A second cluster with other names, sizes and ports runs beside it (its own directory and ports):
#
#   SLURM_LOCAL_DIR=/tmp/slurm-long SLURM_LOCAL_NODES=192 SLURM_LOCAL_NODE_PREFIX=gyre-compute-node- \
#     SLURM_LOCAL_NODE_DIGITS=4 SLURM_LOCAL_PORT_OFFSET=1000 WITH_DBD=0 slurm/local-cluster.sh up
#
#   slurm/local-cluster.sh up        # idempotent: a cluster already up is left as it is
#   eval "$(slurm/local-cluster.sh env)"   # export SLURM_CONF for sbatch/srun/squeue/submitit
#   slurm/local-cluster.sh status
#   slurm/local-cluster.sh down      # cancels jobs, then stops the daemons by recorded PID
#
# Knobs (environment): SLURM_LOCAL_DIR (default /tmp/slurm-local), SLURM_LOCAL_NODES (8),
# SLURM_LOCAL_CPUS (CPUs declared per node, 4), WITH_DBD (1: accounting; 0: none, 0.5 s faster),
# ADD_HOSTS (1: map n1..nN to 127.0.0.1 in /etc/hosts, for tools that resolve node names),
# SLURM_LOCAL_NODE_PREFIX (n) and SLURM_LOCAL_NODE_DIGITS (0: n1..n8; 4: n0001..), the node names,
# SLURM_LOCAL_PORT_OFFSET (0), added to every port below, so two clusters never share one,
# SLURM_LOCAL_MSG_TIMEOUT (10 s, Slurm's default): how long srun waits for a node's launch reply.
# Why each slurm.conf line is there: ../shared/notes/slurm-local.md (measured on this image).
set -euo pipefail

SLAB=${SLURM_LOCAL_DIR:-/tmp/slurm-local}
NNODES=${SLURM_LOCAL_NODES:-8}
NODE_CPUS=${SLURM_LOCAL_CPUS:-4}
WITH_DBD=${WITH_DBD:-1}
ADD_HOSTS=${ADD_HOSTS:-0}
PREFIX=${SLURM_LOCAL_NODE_PREFIX:-n}
DIGITS=${SLURM_LOCAL_NODE_DIGITS:-0}
OFFSET=${SLURM_LOCAL_PORT_OFFSET:-0}
MSG_TIMEOUT=${SLURM_LOCAL_MSG_TIMEOUT:-10}
knob() {  # knob NAME VALUE REGEX WHAT: stop with a clear line on a bad value
    [[ $2 =~ $3 ]] || { echo "local-cluster: $1=$2: want $4" >&2; exit 2; }
}
knob SLURM_LOCAL_NODES "$NNODES" '^[1-9][0-9]*$' "a node count >= 1"
knob SLURM_LOCAL_NODE_DIGITS "$DIGITS" '^[0-9]$' "0..9 digits"
knob SLURM_LOCAL_NODE_PREFIX "$PREFIX" '^[A-Za-z][A-Za-z0-9-]*$' "a letter, then letters, digits or '-'"
knob SLURM_LOCAL_PORT_OFFSET "$OFFSET" '^[0-9]+$' "an integer >= 0"
knob SLURM_LOCAL_MSG_TIMEOUT "$MSG_TIMEOUT" '^[1-9][0-9]*$' "seconds >= 1"
CTLD_PORT=$((16817 + OFFSET))
DBD_PORT=$((16819 + OFFSET))
MYSQL_PORT=$((13306 + OFFSET))
NODE_PORT0=$((17001 + OFFSET))
CONF=$SLAB/etc/slurm.conf
PIDS=$SLAB/run/pids            # "name pid" per line, in start order; `down` reads it backwards
HOSTS_TAG="# slurm-local-up $SLAB"   # per cluster: one cluster's `down` leaves another's lines
APT_LINE="apt-get install -y --no-install-recommends slurm-wlm munge slurmdbd mariadb-server"

die() { echo "local-cluster: $*" >&2; exit 1; }
log() { echo "local-cluster: $*" >&2; }

# A PID is alive if it exists and is not a zombie (PID 1 here reaps orphans late).
alive() {
    local pid=$1 state
    [[ -r /proc/$pid/stat ]] || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ -n $state && $state != Z ]]
}

need_binaries() {
    local missing=() b
    local want=(munged mungekey slurmctld slurmd sbatch srun scontrol sinfo squeue scancel)
    [[ $WITH_DBD == 1 ]] && want+=(slurmdbd mariadbd mariadb-install-db mariadb sacct)
    for b in "${want[@]}"; do
        command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] || missing+=("$b")
    done
    if ((${#missing[@]})); then
        die "missing ${missing[*]}; install them with: $APT_LINE"
    fi
}

node() { printf '%s%0*d' "$PREFIX" "$DIGITS" "$1"; }   # node 7 -> n7, or gyre-compute-node-0007
NODES="$PREFIX[$(printf '%0*d' "$DIGITS" 1)-$(printf '%0*d' "$DIGITS" "$NNODES")]"   # Slurm's hostlist form

bin() { command -v "$1" 2>/dev/null || echo "/usr/sbin/$1"; }

# wait_for SECONDS WHAT LOGFILE CMD...: poll CMD every 0.1 s; on timeout show the log's tail.
wait_for() {
    local secs=$1 what=$2 logf=$3; shift 3
    local end=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= end)); then
            log "$what not ready after ${secs}s; last lines of $logf:"
            tail -n 15 "$logf" >&2 2>/dev/null || true
            exit 1
        fi
        sleep 0.1
    done
}

start() {  # start NAME LOGFILE CMD...: run a daemon in the foreground mode, in the background
    local name=$1 logf=$2; shift 2
    "$@" >>"$logf" 2>&1 </dev/null &
    echo "$name $!" >>"$PIDS"
}

is_up() {
    [[ -s $PIDS ]] || return 1
    local name pid
    while read -r name pid; do alive "$pid" || return 1; done <"$PIDS"
    SLURM_CONF=$CONF scontrol ping 2>/dev/null | grep -q 'is UP'
}

write_slurm_conf() {
    local user; user=$(id -un)
    local acct="AccountingStorageType=accounting_storage/none"
    if [[ $WITH_DBD == 1 ]]; then
        # The slurmctld->slurmdbd link ignores AuthInfo=socket=; it takes the socket from here.
        acct="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$SLAB/munge/munge.socket.2"
    fi
    cat >"$CONF" <<EOF
# Written by slurm/local-cluster.sh; every line is explained in shared/notes/slurm-local.md.
ClusterName=gyreci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SLAB/munge/munge.socket.2
StateSaveLocation=$SLAB/state
SlurmdSpoolDir=$SLAB/spool/%n
SlurmctldPidFile=$SLAB/run/slurmctld.pid
SlurmdPidFile=$SLAB/run/slurmd-%n.pid
SlurmctldLogFile=$SLAB/log/slurmctld.log
SlurmdLogFile=$SLAB/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/filetxt
JobCompLoc=$SLAB/log/jobcomp.txt
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
InactiveLimit=0
KillWait=5
MinJobAge=4
SlurmdTimeout=60
MessageTimeout=$MSG_TIMEOUT
$acct
NodeName=$NODES NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$NODE_PORT0-$((NODE_PORT0 + NNODES - 1))] CPUs=$NODE_CPUS RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    # slurmdbd has no -f: its config must sit beside slurm.conf, mode 0600.
    cat >"$SLAB/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$SLAB/munge/munge.socket.2
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=$user
LogFile=$SLAB/log/slurmdbd.log
PidFile=$SLAB/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MYSQL_PORT
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$SLAB/etc/slurmdbd.conf"
}

start_munge() {
    if [[ ! -s $SLAB/munge/munge.key ]]; then
        mungekey --create --keyfile="$SLAB/munge/munge.key"
        chmod 400 "$SLAB/munge/munge.key"
    fi
    rm -f "$SLAB/munge/munge.socket.2" "$SLAB/munge/munge.socket.2.lock"
    start munged "$SLAB/log/munged.out" "$(bin munged)" -F --key-file="$SLAB/munge/munge.key" \
        --socket="$SLAB/munge/munge.socket.2" --pid-file="$SLAB/munge/munged.pid" \
        --log-file="$SLAB/log/munged.log" --seed-file="$SLAB/munge/munged.seed"
    wait_for 10 munged "$SLAB/log/munged.log" test -S "$SLAB/munge/munge.socket.2"
}

start_mariadb() {
    local fresh=0 user_opt=()
    [[ $(id -u) == 0 ]] && user_opt=(--user=root)
    if [[ ! -d $SLAB/mysql/mysql ]]; then
        fresh=1
        mariadb-install-db --datadir="$SLAB/mysql" "${user_opt[@]}" --skip-test-db \
            --auth-root-authentication-method=normal >"$SLAB/log/mariadb-install.log" 2>&1 \
            || { tail -n 15 "$SLAB/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
    fi
    start mariadbd "$SLAB/log/mariadb.out" "$(bin mariadbd)" --no-defaults --datadir="$SLAB/mysql" "${user_opt[@]}" \
        --bind-address=127.0.0.1 --port=$MYSQL_PORT --socket="$SLAB/run/mysql.sock" \
        --pid-file="$SLAB/run/mariadb.pid" --log-error="$SLAB/log/mariadb.log" \
        --innodb-buffer-pool-size=64M --skip-name-resolve
    wait_for 60 mariadbd "$SLAB/log/mariadb.log" mariadb-admin --no-defaults -S "$SLAB/run/mysql.sock" -uroot ping
    if ((fresh)); then
        mariadb --no-defaults -S "$SLAB/run/mysql.sock" -uroot -e \
            "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
             GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
    fi
}

ctld_up() { SLURM_CONF=$CONF scontrol ping | grep -q 'is UP'; }
# Every node registered and usable (idle, or mixed/allocated if jobs survived a restart).
nodes_ready() {
    local states; states=$(SLURM_CONF=$CONF sinfo -h -N -o '%T' 2>/dev/null) || return 1
    [[ $(grep -c . <<<"$states") == "$NNODES" ]] || return 1
    ! grep -qvE '^(idle|mixed|allocated)$' <<<"$states"
}

cmd_up() {
    need_binaries
    if is_up; then log "already up ($CONF)"; return 0; fi
    [[ -s $PIDS ]] && { log "a previous cluster is half up; stopping it first"; cmd_down; }
    local t0=$SECONDS
    mkdir -p "$SLAB"/{etc,state,log,run,munge}
    local i
    for ((i = 1; i <= NNODES; i++)); do mkdir -p "$SLAB/spool/$(node "$i")"; done
    chmod 755 "$SLAB/munge"   # munged refuses a socket directory without execute for all
    : >"$PIDS"
    write_slurm_conf
    start_munge
    if [[ $WITH_DBD == 1 ]]; then
        start_mariadb
        : >>"$SLAB/log/slurmdbd.log"
        local mark; mark=$(wc -l <"$SLAB/log/slurmdbd.log")
        start slurmdbd "$SLAB/log/slurmdbd.out" env SLURM_CONF="$CONF" "$(bin slurmdbd)" -D
        wait_for 30 slurmdbd "$SLAB/log/slurmdbd.log" \
            bash -c "tail -n +$((mark + 1)) '$SLAB/log/slurmdbd.log' | grep -q 'slurmdbd version .* started'"
    fi
    start slurmctld "$SLAB/log/slurmctld.out" "$(bin slurmctld)" -D -f "$CONF"
    wait_for 30 slurmctld "$SLAB/log/slurmctld.log" ctld_up
    local name
    for ((i = 1; i <= NNODES; i++)); do
        name=$(node "$i")
        start "slurmd-$name" "$SLAB/log/slurmd-$name.out" "$(bin slurmd)" -D -f "$CONF" -N "$name"
    done
    # Registration takes longer with many slurmd (192 on 2 loaded cores: up in 3-6 s, 2026-12-06).
    wait_for $((30 + NNODES / 4)) "slurmd x$NNODES" "$SLAB/log/slurmd-$(node 1).log" nodes_ready
    if [[ $ADD_HOSTS == 1 ]] && ! grep -qF "$HOSTS_TAG" /etc/hosts; then
        # 16 names a line keeps each /etc/hosts line short at any node count.
        local line=()
        for ((i = 1; i <= NNODES; i++)); do
            line+=("$(node "$i")")
            if ((${#line[@]} == 16 || i == NNODES)); then
                echo "127.0.0.1 ${line[*]} $HOSTS_TAG" >>/etc/hosts
                line=()
            fi
        done
    fi
    log "up in $((SECONDS - t0))s: $NNODES nodes $NODES; use: eval \"\$($0 env)\""
}

cmd_env() {
    echo "export SLURM_CONF=$CONF"
}

cmd_status() {
    if is_up; then
        SLURM_CONF=$CONF sinfo
        SLURM_CONF=$CONF squeue
    else
        echo "local-cluster: down"
        return 3
    fi
}

# SIGTERM the recorded PIDs (newest first), wait up to 20 s each, then SIGKILL the survivors.
stop_recorded() {
    local lines=() line name pid
    mapfile -t lines <"$PIDS"
    for ((i = ${#lines[@]} - 1; i >= 0; i--)); do
        read -r name pid <<<"${lines[i]}"
        alive "$pid" && kill -TERM "$pid" 2>/dev/null || true
    done
    for ((i = ${#lines[@]} - 1; i >= 0; i--)); do
        read -r name pid <<<"${lines[i]}"
        local end=$((SECONDS + 20))
        while alive "$pid" && ((SECONDS < end)); do sleep 0.1; done
        if alive "$pid"; then
            log "$name ($pid) ignored SIGTERM for 20s; SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
}

cmd_down() {
    if [[ -s $PIDS ]] && ctld_up 2>/dev/null; then
        # slurmstepd and the tasks are not children of slurmd: end the jobs before the daemons.
        local jobs; jobs=$(SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            SLURM_CONF=$CONF scancel $jobs 2>/dev/null || true
            local end=$((SECONDS + 30))
            while [[ -n $(SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null) ]] && ((SECONDS < end)); do sleep 0.2; done
        fi
    fi
    [[ -f $PIDS ]] && stop_recorded
    rm -f "$PIDS"
    if grep -qF "$HOSTS_TAG" /etc/hosts 2>/dev/null; then
        # /etc/hosts may be a bind mount: rewrite in place rather than replace the file.
        local kept; kept=$(grep -vF "$HOSTS_TAG" /etc/hosts)
        printf '%s\n' "$kept" >/etc/hosts
    fi
    log "down"
}

case ${1:-} in
    up) cmd_up ;;
    env) cmd_env ;;
    status) cmd_status ;;
    down) cmd_down ;;
    *) echo "usage: $0 up|env|status|down" >&2; exit 2 ;;
esac
