"""What drives SGLang's servers and measures the series: one package, a module per job.
Tests import it; it imports nothing under tests/. Run from the checkout's root (as the
Makefile does), e.g. `python -m harness.compare --help`.

  servers.py         one server's lifecycle (start, wait, probe, stop) and fleets of them
  project.py         the pins, the series' state, the trees a run uses, the --out check
  compare/           `make e2e`: native vs kvcached at the server, every pool kind
  soak/              `make soak`: several models on one GPU under load and faults
  bench_server.py    `make bench-server`: SGLang's bench_serving, kvcached vs native
  sharing/           `make bench-sharing`: several models sharing one GPU with HiCache vs a static split
  transfer_bench.py  `make bench`: HiCache's host transfers; plot.py draws a run
  differential/      the differential gate: pristine SGLang vs the patched tree, case by case
  emulation/         SGLang's compiled copy kernels emulated on CPU, and allocator stand-ins
  results.py         the committed summaries' schema (results/*.json), made from a run's report
  report.py          `make report`: docs/results.md rendered from the summaries (--check)
  checkpoint.py      a trained GGUF checkpoint as a Hugging Face folder
  mooncake_store.py  a mooncake_master on loopback for HiCache's L3 tier
  models.py          the model shapes tests and benchmarks share; kvcached_groups.py: a workaround
  mutants/           `make mutants`: the mutation audit of the CPU tier
  rig/               GPU-session tooling: stand-ins, sglang-kernel's real ops, the device session
  fakes/             stand-in servers and clients the tools are tested with on the CPU
"""
