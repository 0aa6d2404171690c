#!/bin/bash
# The repeat protocol of validate/README.md for the trace loop, as these runs were recorded:
# each command starts once the 1-minute load average is under 1.0 (waits at most 5 minutes).
# Run from an empty folder with `collsim` on the PATH; writes times.txt, cpu_profile.*, runN/.
# Per run: the timed steps at world sizes 2 and 4 with their traces, then world size 2 again with
# both ranks pinned to core 0 (`taskset -c 0`), whose traced local steps give the profile its
# time-sharing slowdown (two ranks per core, as world size 4 runs on 2 cores), started right
# after its run, beside the same command pinned to core 1 (its traces unused): core 1 as busy as
# in the reference and at world size 4 (a pinned pair beside an idle core runs each op faster,
# collsim.validate.fit.trace_host.time_sharing). About 11 minutes on 2 quiet cores, most of it
# waiting for the load to settle.
# For a development run on a busy host: NO_WAIT=1 (no load rule), RUNS="1", ITERS=5; such runs
# are not the protocol.
ITERS=${ITERS:-15}
RUNS=${RUNS:-1 2 3}
stamp(){ echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> times.txt; }
waitq(){
  [ -n "$NO_WAIT" ] && return
  for _ in $(seq 1 60); do l=$(cut -d' ' -f1 /proc/loadavg); awk "BEGIN{exit !($l<1.0)}" && return; sleep 5; done
}
waitq; stamp start compute
collsim validate compute -o cpu_profile.yaml > cpu_profile.txt 2>&1; stamp end compute rc=$?
for n in $RUNS; do
  mkdir -p run$n/pinned; waitq; stamp start run$n
  collsim validate step --world-sizes 2,4 --iters "$ITERS" --device-profile cpu_profile.yaml \
    --profile-dir traces_run$n -o run$n/step_trace_run$n.json > run$n/step_trace_run$n.txt 2>&1
  stamp end run$n rc=$?
  stamp start run$n pinned  # at once: the load average then still holds this run's own ranks
  taskset -c 1 collsim validate step --world-sizes 2 --iters 3 --warmup 0 \
    --profile-dir pinned_core1_run$n -o pinned_core1_run$n.json > pinned_core1_run$n.txt 2>&1 &
  beside=$!
  taskset -c 0 collsim validate step --world-sizes 2 --iters 1 --warmup 0 \
    --profile-dir pinned_run$n -o run$n/pinned/step_pinned.json > run$n/pinned/step_pinned.txt 2>&1
  rc=$?; wait $beside
  stamp end run$n pinned rc=$rc beside rc=$?
done
echo done >> times.txt
for n in $RUNS; do
  cp traces_run$n/n2_ddp_b25_rank{0,1}.json.gz traces_run$n/n2_local_rank{0,1}.json.gz run$n/
  cp pinned_run$n/n2_local_rank{0,1}.json.gz run$n/pinned/
  collsim validate trace run$n/n2_ddp_b25_rank0.json.gz run$n/n2_ddp_b25_rank1.json.gz \
    --pinned run$n/pinned/n2_local_rank0.json.gz --pinned run$n/pinned/n2_local_rank1.json.gz \
    --pinned-reference run$n/n2_local_rank0.json.gz \
    --pinned-reference run$n/n2_local_rank1.json.gz \
    --profile-out run$n/trace_profile.yaml > run$n/trace.txt 2>&1
done
