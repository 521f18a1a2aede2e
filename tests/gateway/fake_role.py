"""A stand-in role process for `baton up` tests: `FAKE_ROLE_EXIT=N` exits with N at once,
otherwise it prints `READY port=1` and sleeps until terminated."""
import os
import sys
import time

if __name__ == "__main__":
    code = os.environ.get("FAKE_ROLE_EXIT")
    if code is not None:
        print("fake role failing on purpose", file=sys.stderr, flush=True)
        sys.exit(int(code))
    print("READY port=1", flush=True)
    time.sleep(600)
