"""The prefill worker: a gRPC PrefillService around one engine in prefill role.

A request's walk through this package (decode first, push model):
  1. servicer.Handshake: once per decode peer, KV layouts (model, dtype, block_size, layers,
     KV heads, head size, protocol version) and transports must agree, else an error naming
     the differing field.
  2. servicer.Prefill → worker.PrefillWorker.prefill: validate, run the prompt through the
     engine (its own prefix cache, batched and chunked by its scheduler), sample the first
     token, send the blocks the decode worker lacks into its dst_block_ids, reply with the
     token and counts; the blocks stay held under a lease (lease.py). The request is a
     sequence.PrefillSequence whose PrefillState changes in one place.
  3. servicer.ReleaseBlocks (or lease expiry): the hold ends; blocks stay in the prefix cache.
  4. servicer.Abort at any point; never frees blocks while their transfer is in flight, and
     leaves a tombstone (lease.py) so a Prefill arriving after its Abort is refused.
server.py wires it into a process (`python -m prefill_service`, see config.py for flags).
"""
