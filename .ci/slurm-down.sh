#!/usr/bin/env bash
# Stop the one-node SLURM cluster that .ci/slurm-up.sh started: exactly the daemons whose
# process ids it recorded (slurmd, slurmctld, munged), nothing else. Jobs still queued or
# running on that cluster are cancelled first. /etc/slurm/slurm.conf is left in place
# (slurm-up.sh rewrites it; delete it by hand to hand the path back).
set -uo pipefail

STATE_DIR=${SERVINGPLAN_SLURM_DIR:-/tmp/servingplan-slurm}
PID_DIR=$STATE_DIR/pids

log() { echo "slurm-down: $*"; }

alive() { [ -n "${1:-}" ] && [ -r "/proc/$1/comm" ] && [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ]; }

if [ ! -d "$PID_DIR" ] || [ -z "$(ls -A "$PID_DIR" 2>/dev/null)" ]; then
    log "nothing recorded in $PID_DIR; nothing to stop"
    exit 0
fi

ctld_pid=$(cat "$PID_DIR/slurmctld.pid" 2>/dev/null || true)
if alive "$ctld_pid" slurmctld; then
    # the controller is ours, so every job in it is ours too
    jobs=$(timeout 10 squeue -h -t PENDING,RUNNING,CONFIGURING,COMPLETING,SUSPENDED -o %i 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        timeout 20 scancel $jobs || true
        for _ in $(seq 30); do
            [ -z "$(timeout 10 squeue -h -t RUNNING,COMPLETING -o %i 2>/dev/null)" ] && break
            sleep 1
        done
    fi
fi

rc=0
for name in slurmd slurmctld munged; do
    f=$PID_DIR/$name.pid
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    if alive "$pid" "$name"; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 100); do alive "$pid" "$name" || break; sleep 0.1; done
        if alive "$pid" "$name"; then
            log "$name (pid $pid) ignored SIGTERM; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            sleep 0.5
        fi
        if alive "$pid" "$name"; then
            log "could not stop $name (pid $pid)"; rc=1; continue
        fi
        log "stopped $name (pid $pid)"
    else
        log "$name (recorded pid $pid) was not running"
    fi
    rm -f "$f"
done
exit $rc
