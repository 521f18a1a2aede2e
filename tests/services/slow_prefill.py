"""`python -m tests.services.slow_prefill SECONDS ARGS`: the real prefill worker process whose
transfers for request ids starting with "slow" stay in flight (from its own point of view)
for SECONDS after the bytes were posted, printing `SENDING <transfer id>` first, so a test
can kill or stop it mid-transfer. Other requests run normally."""
import asyncio
import sys

from baton.transfer import KVSender
from prefill_service.server import main


def _slow(seconds: float):
    real = KVSender.wait_async

    async def wait_async(self, transfer_id, timeout_s):
        if transfer_id.startswith("slow"):
            print(f"SENDING {transfer_id}", flush=True)
            await asyncio.sleep(seconds)
        return await real(self, transfer_id, timeout_s)

    return wait_async


if __name__ == "__main__":
    KVSender.wait_async = _slow(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
