#!/usr/bin/env bash
# The GPU measurements of the 1B shape and its peers, in parts that each fit a 10-minute device command.
# Run from the repo root on the GPU machine (../shared/gpu/README.md). Here, first:
#   EXTRA="tensorboardX==2.6.5" ../shared/gpu/fetch-wheels.sh   # grain, array-record, tensorboardX wheels
#   mkdir -p .peer && cp ../shared/bench/torch_llama_peer.py .peer/ && echo /.peer/ >> .git/info/exclude
# then send `.whl` and `.peer` along with each part:
#
#   bash bench/gpu_session.sh ours    # bench.step on the 1B shape: batches, remat, loss_chunk
#   bash bench/gpu_session.sh peer    # the PyTorch peer at batch 4 and 8, same machine
#   bash bench/gpu_session.sh ablate  # b8 with one change undone: attention, remat, XLA flag
#   bash bench/gpu_session.sh more    # tiny and 3B points, bf16-vs-float32 on real text
#   bash bench/gpu_session.sh ring    # cuDNN's ring blocks against the float32 reference (bench.ring_blocks)
#   bash bench/gpu_session.sh lease   # one short lease: ours and the peer at b8 first, then b4 and
#                                     # the memory-saving rows while DEADLINE_S (default 480) lasts
#
# Each run writes $OUT/<name>.log (and .json for bench.step); a run that fails (an OOM, say) is
# noted and the next goes on. The last lines are a table of what this part measured.
# DRY=1 swaps every config for the tiny preset on CPU, to check the script itself.
set -uo pipefail
part=${1:?usage: bench/gpu_session.sh ours|peer|ablate|more|ring|lease}
start=$SECONDS
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
PY=${PY:-python3}

left() { echo $(( ${DEADLINE_S:-100000} - (SECONDS - start) )); }
cap() { local l; l=$(left); echo $(( l - 5 < $1 ? l - 5 : $1 )); }  # a run's timeout: its own, or what is left

step() {  # step NAME CONFIG [key=value ...]: one bench.step row
  local name=$1 config=$2; shift 2
  if [ "$(left)" -lt 90 ]; then echo "== $name: skipped, $(left) s left"; return; fi
  if [ -n "${DRY:-}" ]; then config=tiny; set -- mesh.data=1; fi
  echo "== $name: bench.step --config $config $*"
  if ! timeout "$(cap 300)" $PY -m bench.step --config "$config" --steps 10 --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1; then
    echo "   failed; the end of $OUT/$name.log:"
    tail -n 2 "$OUT/$name.log"
  fi
}

peer() {  # peer BATCH: the PyTorch peer on the same machine
  if [ -n "${DRY:-}" ]; then echo "DRY: no peer on CPU"; return; fi
  if [ "$(left)" -lt 120 ]; then echo "== peer b$1: skipped, $(left) s left"; return; fi
  echo "== peer b$1"
  timeout "$(cap 280)" $PY .peer/torch_llama_peer.py --batch "$1" >"$OUT/peer-b$1.log" 2>&1 || echo "   failed (exit $?)"
  grep "torch peer" "$OUT/peer-b$1.log"
}

case $part in
  ours)
    B=configs/llama3-1b.yaml
    step b4 $B train.global_batch=4
    step b8 $B train.global_batch=8
    step b8-chunk512 $B train.global_batch=8 model.loss_chunk=512
    step b8-full $B train.global_batch=8 model.remat=full model.loss_chunk=512
    step b16-full $B train.global_batch=16 model.remat=full model.loss_chunk=512
    ;;
  ablate)  # one change at a time against b8: each change's own effect
    B=configs/llama3-1b.yaml
    step b8-dot-product $B train.global_batch=8 model.attention=dot_product
    step b8-remat-none $B train.global_batch=8 model.remat=none model.loss_chunk=512
    XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=false ${XLA_FLAGS:-}" \
      step b8-no-lhs $B train.global_batch=8
    ;;
  peer)
    for b in 4 8; do peer $b; done
    exit 0
    ;;
  lease)  # what one 15-minute lease can hold, most telling first
    : "${DEADLINE_S:=480}"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    $PY -c "import jax; print('jax', jax.__version__, jax.devices())"
    B=configs/llama3-1b.yaml
    step b8 $B train.global_batch=8
    peer 8
    # cuDNN's ring blocks checked against the reference: only a GPU can (about a minute).
    [ "$(left)" -gt 120 ] && { timeout "$(cap 120)" $PY -m bench.ring_blocks ${DRY:+--dry} >"$OUT/ring_blocks.log" 2>&1
                               tail -n 1 "$OUT/ring_blocks.log"; }
    step b4 $B train.global_batch=4
    step b8-chunk512 $B train.global_batch=8 model.loss_chunk=512
    peer 4
    step b16-full $B train.global_batch=16 model.remat=full model.loss_chunk=512
    ;;
  more)
    step tiny tiny
    step 3b-b4 configs/llama3-3b.yaml train.global_batch=4
    step 3b-b2 configs/llama3-3b.yaml train.global_batch=2
    # xla attention in both runs: cuDNN's flash kernel has no float32 path.
    precision=(configs/llama3-1b.yaml data.source=text model.seq_len=1024 train.global_batch=8 model.vocab_size=384
               model.attention=xla)
    if [ -n "${DRY:-}" ]; then precision=(tiny --steps 5); fi
    echo "== precision: bench.precision --config ${precision[*]}"
    timeout 300 $PY -m bench.precision --config "${precision[@]}" >"$OUT/precision.log" 2>&1 || echo "   exit $?"
    grep -A12 "^| step" "$OUT/precision.log"
    ;;
  ring)
    timeout "$(cap 300)" $PY -m bench.ring_blocks ${DRY:+--dry} 2>&1 | tee "$OUT/ring_blocks.log"
    ;;
  *) echo "unknown part $part (ours|peer|ablate|more|ring|lease)"; exit 2 ;;
esac

$PY - "$OUT" <<'EOF'
import glob, json, os, sys
rows = [(os.path.basename(p)[:-5], json.load(open(p))) for p in sorted(glob.glob(os.path.join(sys.argv[1], "*.json")))]
print("| run | device | batch x seq | tokens/s | step ms | MFU | peak GiB | compile s |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for name, r in rows:
    mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
    print(f"| {name} | {r['device']} | {r['batch']} x {r['seq']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {mfu} | "
          f"{r['peak_memory_gib']:.1f} ({r['memory_from']}) | {r['compile_s']:.1f} |")
EOF
