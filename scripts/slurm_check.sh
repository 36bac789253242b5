#!/usr/bin/env bash
# A real one-node SLURM runs what docs/sweeps.md and docs/clusters.md tell users to submit
# (`make test-slurm` runs this after installing Debian's slurmctld, slurmd and munge; this
# script installs nothing):
#   1. starts munged, slurmctld and slurmd on this host, from a slurm.conf written to a fresh
#      temporary directory (one node: this host, its CPUs from nproc, its memory from free), on
#      free ports, and waits until sinfo shows the node idle (60 s at most, else the daemons'
#      log tails and exit 1);
#   2. submits a 2-point sweep's `train.py --sweep FILE --emit slurm` array job with
#      `sbatch --wait` and checks that every point finished: exit 0 and COMPLETED in SLURM's
#      job-completion log, and its run.dir holds every step's metrics and the final checkpoint;
#   3. runs `srun --ntasks=2 train.py` (2 processes x 4 fake CPU devices, no dist.* keys:
#      jax.distributed reads the layout from SLURM's environment) and checks its losses equal
#      a 1 x 8 run's.
# Every daemon it started is stopped on exit, whatever happened (trap), and the directory removed
# (KEEP=1 keeps it). Usage: scripts/slurm_check.sh   (PYTHON: the interpreter, default .venv's)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
STEPS=4
WORK=$(mktemp -d /tmp/meshlm-slurm.XXXXXX)
chmod 755 "$WORK"  # munged wants its socket's directory searchable by every user
export SLURM_CONF=$WORK/slurm.conf
DAEMON_PIDS=()
DAEMON_NAMES=()
CHILD=""

say() { echo "slurm check: $*"; }

# Runs a command in the background and waits for it: bash runs a trap only once the foreground
# command returns, so a SIGTERM (a CI timeout) would otherwise wait for the whole job.
run() {
    "$@" &
    CHILD=$!
    local code=0
    wait "$CHILD" || code=$?
    CHILD=""
    return "$code"
}

tails() {
    for log in "$WORK"/munged.log "$WORK"/slurmctld.log "$WORK"/slurmd.log; do
        [[ -f $log ]] && { echo "--- last lines of $log"; tail -n 15 "$log"; }
    done
    return 0
}

fail() {
    echo "slurm check: FAILED: $*" >&2
    tails >&2
    exit 1
}

stop() {
    local code=$?
    # The command being waited for, then the jobs (their slurmstepd processes outlive slurmd),
    # then the daemons, newest first.
    if [[ -n $CHILD ]]; then
        kill "$CHILD" 2>/dev/null || true
        wait "$CHILD" 2>/dev/null || true
    fi
    if [[ ${#DAEMON_PIDS[@]} -ge 2 ]] && [[ -n $(timeout 5 squeue -h -o %i 2>/dev/null) ]]; then
        timeout 5 scancel --full --partition=check 2>/dev/null || true
        for _ in $(seq 30); do [[ -z $(timeout 5 squeue -h -o %i 2>/dev/null) ]] && break; sleep 1; done
    fi
    for ((i = ${#DAEMON_PIDS[@]} - 1; i >= 0; i--)); do kill "${DAEMON_PIDS[i]}" 2>/dev/null || true; done
    for pid in "${DAEMON_PIDS[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && { echo "slurm check: daemon $pid ignored SIGTERM; killing it" >&2; kill -9 "$pid"; }
    done
    if [[ ${KEEP:-0} == 1 ]]; then say "kept $WORK"; else rm -rf "$WORK"; fi
    exit "$code"
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for tool in munged slurmctld slurmd sinfo sbatch srun squeue scancel; do
    command -v "$tool" >/dev/null || fail "$tool is not installed (make test-slurm installs Debian's slurmctld, slurmd and munge)"
done
[[ -x $PYTHON ]] || fail "no Python at $PYTHON (make venv, or set PYTHON)"

# ---- 1. the cluster
NODE=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(free -m | awk '/^Mem:/ {print $2}')
read -r CTLD_PORT SLURMD_PORT < <("$PYTHON" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("", 0))
print(*(s.getsockname()[1] for s in socks))')

dd if=/dev/urandom of="$WORK/munge.key" bs=1024 count=1 status=none
chmod 400 "$WORK/munge.key"
mkdir -p "$WORK/state" "$WORK/spool"
cat >"$SLURM_CONF" <<EOF
ClusterName=meshlm-check
SlurmctldHost=$NODE
SlurmUser=$(id -un)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$WORK/munge.socket
CredType=cred/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$WORK/jobcomp.log
NodeName=$NODE CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=check Nodes=$NODE Default=YES MaxTime=30 State=UP
EOF

say "starting munged, slurmctld and slurmd in $WORK (node $NODE: $CPUS CPUs, $MEM_MB MB)"
munged --foreground --force --key-file="$WORK/munge.key" --socket="$WORK/munge.socket" \
    --pid-file="$WORK/munged.pid" --seed-file="$WORK/munged.seed" 2>"$WORK/munged.log" &
DAEMON_PIDS+=($!) DAEMON_NAMES+=(munged)
slurmctld -D -i -f "$SLURM_CONF" >"$WORK/slurmctld.log" 2>&1 &
DAEMON_PIDS+=($!) DAEMON_NAMES+=(slurmctld)
slurmd -D -f "$SLURM_CONF" >"$WORK/slurmd.log" 2>&1 &
DAEMON_PIDS+=($!) DAEMON_NAMES+=(slurmd)

state=""
started=$SECONDS
while ((SECONDS - started < 60)); do
    state=$(timeout 5 sinfo -h -n "$NODE" -o %t 2>/dev/null || true)
    [[ $state == idle ]] && break
    for i in "${!DAEMON_PIDS[@]}"; do
        kill -0 "${DAEMON_PIDS[i]}" 2>/dev/null || fail "${DAEMON_NAMES[i]} exited while starting (its log below)"
    done
    sleep 1
done
[[ $state == idle ]] || fail "node $NODE is not idle after 60 s (sinfo says '${state:-nothing}')"
say "node $NODE idle $((SECONDS - started)) s after the daemons started"

# ---- 2. a sweep's array job
unset XLA_FLAGS  # train.py sets the device count itself, per process
export JAX_PLATFORMS=cpu PYTHON
DATA="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/json/**/*.py"
SWEEP=$WORK/sweep
cat >"$WORK/sweep.yaml" <<EOF
base: $ROOT/configs/tiny.yaml
overrides:
  train.steps: $STEPS
  train.log_every: 1
  checkpoint.every: $STEPS
  data.path: "$DATA"
grid:
  optim.lr: [1.0e-3, 3.0e-3]
dir: $SWEEP
slurm: ["--time=10", "--cpus-per-task=1"]
EOF
"$PYTHON" train.py --sweep "$WORK/sweep.yaml" --emit slurm >/dev/null
say "sbatch --wait $SWEEP/sweep.sbatch (2 points x $STEPS steps)"
run sbatch --wait --quiet "$SWEEP/sweep.sbatch" || fail "the sweep's array job failed (exit $?): $(tail -n 5 "$SWEEP"/slurm-*.out)"
"$PYTHON" - "$WORK/jobcomp.log" "$SWEEP" "$STEPS" <<'EOF' || fail "the sweep's points did not all finish"
import json, os, re, sys
jobcomp, sweep, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
tasks = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in open(jobcomp)]
ends = {t["ArrayTaskId"]: (t["JobState"], t["ExitCode"]) for t in tasks}
assert ends == {"0": ("COMPLETED", "0:0"), "1": ("COMPLETED", "0:0")}, f"array tasks ended {ends}"
points = sorted(d for d in os.listdir(sweep) if os.path.isdir(os.path.join(sweep, d)))
assert points == ["optim.lr=0.001", "optim.lr=0.003"], points
for point in points:
    run = os.path.join(sweep, point)
    logged = [json.loads(line)["step"] for line in open(os.path.join(run, "metrics.jsonl"))]
    assert logged == list(range(1, steps + 1)), f"{point} logged steps {logged}"
    assert os.listdir(os.path.join(run, "checkpoints")) == [str(steps)], f"{point}: no checkpoint of step {steps}"
    print(f"slurm check: {point}: steps 1-{steps}, checkpoint {steps}, array task exit 0")
EOF

# ---- 3. srun --ntasks=2 equals one process
LAYOUT=(--config configs/tiny.yaml mesh.data=2 mesh.fsdp=2 mesh.tensor=2 "train.steps=$STEPS"
        train.log_every=1 "checkpoint.every=$STEPS" "data.path=$DATA")
say "srun --ntasks=2 train.py (2 processes x 4 CPU devices) and the same run in 1 process x 8"
run srun --ntasks=2 --cpus-per-task=1 --time=10 --kill-on-bad-exit=1 --label \
    "$PYTHON" train.py "${LAYOUT[@]}" "run.dir=$WORK/two" >"$WORK/two.out" 2>&1 \
    || fail "srun --ntasks=2 train.py failed; its output ends: $(tail -n 20 "$WORK/two.out")"
run timeout 600 "$PYTHON" train.py "${LAYOUT[@]}" "run.dir=$WORK/one" >"$WORK/one.out" 2>&1 \
    || fail "the 1 x 8 run failed; its output ends: $(tail -n 20 "$WORK/one.out")"
"$PYTHON" - "$WORK" "$STEPS" <<'EOF' || fail "the 2-process run does not train like 1 x 8"
import json, os, sys
import numpy as np
work, steps = sys.argv[1], int(sys.argv[2])
assert "on 8 cpu devices, 1 process(es)" in open(os.path.join(work, "one.out")).read(), "the reference is not 1 x 8"
out = open(os.path.join(work, "two.out")).read()
for said in ["the mesh names 8 devices: running 4 CPU devices per process", "on 8 cpu devices, 2 process(es)"]:
    assert any(line.startswith("0: ") and said in line for line in out.splitlines()), f"task 0 never said {said!r}:\n{out}"
def losses(run):
    return [(r["step"], r["loss"]) for r in map(json.loads, open(os.path.join(work, run, "metrics.jsonl")))]
two, one = losses("two"), losses("one")
assert [s for s, _ in one] == list(range(1, steps + 1)), one
# The tolerance of tests/test_distributed.py's 2 x 4 = 1 x 8: the all-reduces sum in another
# order across processes, which moves the last bit of a float32 loss.
assert [s for s, _ in two] == [s for s, _ in one], f"2 x 4 logged steps {two}"
np.testing.assert_allclose([l for _, l in two], [l for _, l in one], rtol=2e-5, err_msg="2 x 4 under srun vs 1 x 8")
print(f"slurm check: srun 2 x 4 losses equal 1 x 8 (rtol 2e-5) over {steps} steps: {[l for _, l in two]}")
EOF
say "passed"
