"""Every flag of every command says what it does, and --help shows its default."""
import argparse

import pytest

from baton.bench.cli import _parser as bench_parser
from baton.bench.compare import _parser as compare_parser
from baton.cli import _generate_parser
from baton.cluster.flags import build_parser as up_parser
from decode_service.config import build_parser as decode_parser
from gateway.config import build_parser as gateway_parser
from prefill_service.config import build_parser as prefill_parser

PARSERS = {"serve-decode": decode_parser, "serve-prefill": prefill_parser,
           "gateway": gateway_parser, "up": up_parser, "generate": _generate_parser,
           "bench": bench_parser, "bench compare": compare_parser}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_flag_has_help_and_shows_its_default(name):
    parser = PARSERS[name]()
    missing = [a.option_strings[-1] for a in parser._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction) and not a.help]
    assert not missing, f"baton {name}: flags without help: {missing}"
    assert "(default:" in parser.format_help()
