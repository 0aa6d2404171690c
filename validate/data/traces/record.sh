#!/bin/bash
# The repeat protocol of validate/README.md for the trace loop, as these runs were recorded:
# each command starts once the 1-minute load average is under 1.0 (waits at most 5 minutes).
# Run from an empty folder with `collsim` on the PATH; writes times.txt, cpu_profile.*, runN/.
stamp(){ echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> times.txt; }
waitq(){ for _ in $(seq 1 60); do l=$(cut -d' ' -f1 /proc/loadavg); awk "BEGIN{exit !($l<1.0)}" && return; sleep 5; done; }
waitq; stamp start compute
collsim validate compute -o cpu_profile.yaml > cpu_profile.txt 2>&1; stamp end compute rc=$?
for n in 1 2 3; do
  mkdir -p run$n; waitq; stamp start run$n
  collsim validate step --world-sizes 2,4 --iters 15 --device-profile cpu_profile.yaml \
    --profile-dir traces_run$n -o run$n/step_trace_run$n.json > run$n/step_trace_run$n.txt 2>&1
  stamp end run$n rc=$?
done
echo done >> times.txt
for n in 1 2 3; do
  cp traces_run$n/n2_ddp_b25_rank{0,1}.json.gz run$n/
  collsim validate trace run$n/n2_ddp_b25_rank0.json.gz run$n/n2_ddp_b25_rank1.json.gz \
    --profile-out run$n/trace_profile.yaml > run$n/trace.txt 2>&1
done
