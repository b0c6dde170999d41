"""The soak (`make soak`, `python -m harness.soak`): several models on one GPU, each with
HiCache over kvcached, under shifting load and faults, every answer checked against a native
server's solo answer.

  run.py      the phases, the options, the report written as the run goes;
  fleet.py    its servers (launched, watched, killed, restarted) and its event journal;
  traffic.py  the fixed prompt catalogue, streamed requests, the clients;
  kvc.py      kvcached's per-instance counters, the shared KV budget, reclaims;
  faults.py   what each fault does to a shared server and what followed;
  verdict.py  the oracle, the verdict and the report, from the journal alone.
"""
