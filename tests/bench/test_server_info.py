"""What report.json records of the client and the server: Baton's answers, anyone else's."""
import baton
from baton.bench.server_info import client_version, probe_server, save_metrics
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


def test_save_metrics_keeps_the_gateways_and_its_workers_text(fake, tmp_path):
    _, url = fake
    assert save_metrics(url, tmp_path / "m.txt")
    text = (tmp_path / "m.txt").read_text()
    assert "# ---- GET /metrics/workers\n" in text
    workers = text.split("# ---- GET /metrics/workers\n", 1)[1]
    assert workers.strip()  # the fake workers' Prometheus lines


def test_save_metrics_notes_what_did_not_answer(tmp_path):
    with ServerThread(FakeServer(baton=False).app()) as url:
        assert not save_metrics(url, tmp_path / "m.txt")  # neither path is served
        text = (tmp_path / "m.txt").read_text()
    assert "# ---- GET /metrics: HTTP 404" in text
    assert "# ---- GET /metrics/workers: HTTP 404" in text
    assert not save_metrics("http://127.0.0.1:9", tmp_path / "n.txt", timeout_s=1.0)
    assert (tmp_path / "n.txt").read_text().count("ConnectError") == 2
