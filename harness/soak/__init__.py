"""The soak (`make soak`, `python -m harness.soak`): several models on one GPU, each with
HiCache over kvcached, under shifting load and faults, every answer checked against a native
server's solo answer.

  run.py      the phases, the options, the report written as the run goes;
  fleet.py    its servers (launched, watched, killed, restarted) and its event journal;
  traffic.py  the fixed prompt catalogue, streamed requests, the clients;
  kvc.py      kvcached's per-instance counters, the shared KV budget, reclaims;
  faults.py   what each fault does to a shared server and what followed;
  verdict.py  the oracle, the verdict and the report, from the journal alone.

By default three models share the GPU: qwen2-tiny (MHA), deepseek-v2-tiny (MLA) and
qwen3.5-tiny (the Mamba hybrid, KVCACHED_PAGE_SIZE_MB=4 as harness/compare runs it, its
pools mapped whole: --hybrid-reserve), with CUDA graphs on (the soak adds no --disable-cuda-graph). No controller knows the load
(--budget-mode fixed, kvc.py): each server's kvcached limit is set once, and a ballast
(harness/sharing/ballast.py) holds the rest of the GPU, sized after a warm-up (--warmup-s of
every client on every shared server), so that the servers together can map the budget and
no more; pages move from server to server only as kvcached's cap (--max-cached-tokens) and
SGLang's eviction free them. `--dry-run` prints every server's
command and environment and the budget's rules, and starts nothing.

The 10-minute soak on one H100 (or H200), on sglang-kernel's compiled ops. Here first,
once: `bash ../shared/device/e2e/build.sh` and `harness/rig/real_kernels/pack.sh` (they
write .e2e/); then one device call carrying [".e2e"] (a command may run 10 minutes: the
run goes to the background, later calls poll; the whole run takes about 20 minutes: nine
servers start, the solo answers, 60 s of reference load per model, 30 s of warm-up, the
10-minute shared phase, the rejoin):

    source .e2e/setup.sh > $OUT/setup.log 2>&1; source harness/rig/real_kernels/setup.sh > $OUT/kernels.log 2>&1
    harness/trees.sh python3 /tmp/trees > $OUT/trees.log 2>&1
    F="--attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-custom-all-reduce \\
       --linear-attn-prefill-backend triton"
    PYTHONPATH=/tmp/trees/patched:$PYTHONPATH python3 -m harness.soak --native-path /tmp/trees/pristine \\
        --server-flags "$F" --env SGLANG_ENABLE_JIT_DEEPGEMM=false --out /tmp/soak/three.json --detach
    # then call after call (each under 10 minutes, the machine kept), until "done": true:
    S=/tmp/soak/three; for i in $(seq 56); do grep -q '"done": true' $S.status.json && break; sleep 10; done
    cat $S.status.json; tail -n 5 $S.log; cp $S.json $OUT/; gzip -c $S.events.jsonl > $OUT/events.jsonl.gz
    tar czf $OUT/logs.tgz -C /tmp/soak three-logs

The kvcached servers import the patched copy (first on the harness's PYTHONPATH, which
they inherit), the native references the pristine one (--native-path). The report's
`result` is pass only with 0 mismatches, 0 crashes, every fault followed by correct
answers, the ballast holding the GPU and reclaims > 0 (`python -m harness.soak --table
three.json` prints its row).
"""
