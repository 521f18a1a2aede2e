"""The decode worker: a gRPC DecodeService around one engine in decode role.

A request's walk through this package:
  1. servicer.Generate → worker.DecodeWorker.generate: validate, make the job.Job, pick
     local or remote prefill (peers.py handshakes once per prefill worker; layouts must
     agree).
  2. sequence.DecodeSequence.admit, per sequence (one of the n completions): prefix-cache
     lookup and block allocation in the engine; a short uncached suffix is prefilled here
     (conditional disaggregation), a long one by remote_prefill.RemotePrefill: Prefill RPC,
     KV blocks land in the allocated blocks, the receiver confirms every block, then the
     sequence joins the running batch with the first token (or is recomputed here / failed
     when the prefill side fails: a RemoteOutcome). Every state change is in sequence.py.
  3. stream.ResponseBuilder turns engine outputs into TokenChunk and Finished messages.
  4. servicer.Abort / a cancelled call stop it in any state; no block is freed while a
     transfer may still write into it (the engine holds such blocks until the deadline).
server.py wires it into a process (`python -m decode_service`, see config.py for flags);
context.py is what a sequence needs of its worker besides the engine.
"""
