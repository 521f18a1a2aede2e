"""`python -m prefill_service ARGS` (what `baton serve-prefill ARGS` runs)."""
import sys

from prefill_service.server import main

sys.exit(main())
