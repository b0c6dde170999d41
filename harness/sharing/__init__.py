"""`make bench-sharing` (`python -m harness.sharing`): several models sharing one GPU, each
served by SGLang 0.5.20's real server with CUDA graphs on, in four variants an operator
could run (issue 64), under load that shifts between the models and under even load:

  (a) static            a static split, native SGLang, HiCache off;
  (b) static-hicache    a static split, native HiCache (the baseline of every ratio);
  (c) kvcached          kvcached on SGLang as released, HiCache off;
  (d) kvcached-hicache  kvcached with the series and HiCache: the product.

  plan.py     the models (dummy weights redrawn at a trained model's scale by
              harness/compare's plugin), the variants, the plan and its presets, the budget
              arithmetic, each server's flags and environment;
  traffic.py  seeded token-id prompts (multi-turn conversations on shared prefixes), the
              phases' arrivals (bursts, waves, even), the streaming client, the sample;
  ballast.py  the process that holds the rest of the GPU in a kvcached variant's turn;
  run.py      the options, the fleet, the slots, the journal written as the run goes;
  summary.py  the report from the journal alone: metrics, ratios to (b), targets, the
              correctness sample, the markdown, the TTFT plot, the committed summary.

How the budgets are made equal (only with what an operator could set; no controller knows
the load). Every variant gets the same GPU memory for KV, B = kv_budget_gib, and every
server with HiCache the same host pool, `--hicache-size host_gb`, so (b) and (d) hold the
same host memory in total and (a) and (c) none. Device, by variant:
  (a), (b): each of the n models gets B/n: its Mamba state pool (a hybrid's
      --max-mamba-cache-size slots, the same flag in every variant) and `--max-total-tokens`
      = (B/n - state) / KV bytes a token, whole pages; SGLang allocates that pool at start.
  (c), (d): each server's `--max-total-tokens` is what the whole budget holds of its own
      tokens, (B - state) / KV bytes a token, so any one model can grow to all of it; what
      the servers together can map is bounded by the GPU: when the variant's turn begins
      (every server flushed), a ballast process holds
          free - total x (1 - KVCACHED_GPU_UTILIZATION) - (B - mapped),
      `mapped` being what the variant's kvcached pools hold then (their shared-memory
      counters: used and reserved pages), so that the pools can map exactly B in all
      (kvcached maps nothing into its headroom, total x (1 - utilization), where the
      servers' activations grow). The ballast is sized once a slot and held unchanged.
      Each kvcached server keeps at most KVCACHED_MAX_CACHED_TOKENS = cached_fraction x
      its static share of finished requests' tokens cached on the device (kvcached's own
      limit, an operator's setting: without it an idle model would keep its pages); with
      HiCache what is evicted stays in host memory.
The run checks each server's log for what it really got (SGLang's max_total_num_tokens
line, its host pool lines, kvcached's cap line) against the plan, and reports any
difference as a problem.

On one H100 (or H200). Here first, once: `bash ../shared/device/e2e/build.sh` and
`harness/rig/real_kernels/pack.sh` (they write .e2e/); then one device call carrying
[".e2e"] (a command may run 10 minutes: the run goes to the background, later calls poll):

    source .e2e/setup.sh > $OUT/setup.log 2>&1; source harness/rig/real_kernels/setup.sh > $OUT/kernels.log 2>&1
    harness/trees.sh python3 /tmp/trees > $OUT/trees.log 2>&1
    F="--attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-custom-all-reduce \\
       --linear-attn-prefill-backend triton"
    python3 -m harness.sharing --preset two-mha --python python3 --pristine-path /tmp/trees/pristine \\
        --patched-path /tmp/trees/patched --server-flags "$F" --env SGLANG_ENABLE_JIT_DEEPGEMM=false \\
        --out /tmp/sharing/two-mha --detach
    # then call after call (each under 10 minutes, the machine kept), until "done": true:
    S=/tmp/sharing/two-mha; for i in $(seq 56); do grep -q '"done": true' $S/status.json && break; sleep 10; done
    cat $S/status.json; cp $S/report.json $S/summary.md $OUT/; gzip -c $S/journal.jsonl > $OUT/journal.jsonl.gz

`--preset smoke` first (harness/compare's tiny MHA config twice, one round: about 7
minutes with the servers' start), then `two-mha` (two Llama-3.2-1B-shaped servers a
variant, eight at once: about 18 minutes; on an H100 no variant found its load heavy),
`two-mha-overload` (the same at 2 GiB and 48 requests/s a burst, a load that overloads a
static share) and `mix` (MHA, MLA and the Mamba hybrid,
twelve servers at once: about 85 GiB, an H200; about 19 minutes). `--dry-run` prints
every server's command and environment, the budgets, the memory and time estimates, and
starts nothing. Under the bursts and waves the offered load must overload a static share
(a static variant queues, retracts or recomputes evicted prefixes) for the throughputs to
differ: the presets' rates are a first guess, `--set burst_rate=...` tunes them. A run's
summary: `python -m harness.results add sharing NAME OUT/report.json --title ...` (or the
journal, gzipped or not), rendered by `make report`.
"""
