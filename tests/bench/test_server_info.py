"""What report.json records of the client and the server: Baton's answers, anyone else's."""
import baton
from baton.bench.server_info import client_version, probe_server
from tests.bench.fake_server import FakeServer, ServerThread


def test_client_version_is_the_package():
    v = client_version()
    assert v["version"] == baton.__version__
    assert v["commit"] is None or len(v["commit"]) == 12


def test_probe_baton_gateway(fake):
    _, url = fake
    answers = probe_server(url)
    assert answers["version"] == {"version": "9.9.9", "commit": "abc123"}
    assert answers["models"]["data"][0]["max_model_len"] == 4096


def test_probe_other_server_records_what_it_answers():
    with ServerThread(FakeServer(baton=False).app()) as url:
        answers = probe_server(url)
    assert answers["version"]["status"] == 404 and "body" in answers["version"]
    assert answers["models"]["status"] == 404


def test_probe_nothing_listening():
    answers = probe_server("http://127.0.0.1:9", timeout_s=1.0)
    assert "error" in answers["version"] and "error" in answers["models"]
