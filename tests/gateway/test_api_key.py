"""gateway/api_key.py: the `Authorization: Bearer KEY` check shared by HTTP and gRPC."""
import pytest

from gateway.api_key import bearer_matches


@pytest.mark.parametrize("value", [b"Bearer k3y", b"bearer k3y", b"BEARER k3y", b"Bearer  k3y",
                                   b" Bearer k3y "])
def test_bearer_scheme_in_any_case_matches(value):
    assert bearer_matches(value, b"k3y")


@pytest.mark.parametrize("value", [b"", b"k3y", b"Bearer", b"Bearer ", b"Bearer k3", b"Bearer k3yy",
                                   b"Basic k3y", b"Bearerk3y", b"Bearer k3y extra",
                                   b"Bearer\tk3y"])  # RFC 9110: one or more spaces, no tab
def test_anything_else_does_not(value):
    assert not bearer_matches(value, b"k3y")
