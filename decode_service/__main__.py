"""`python -m decode_service ARGS` (what `baton serve-decode ARGS` runs)."""
import sys

from decode_service.server import main

sys.exit(main())
