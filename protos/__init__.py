"""Baton's gRPC contracts (package `baton.v1`): the .proto files and their generated stubs.

Regenerate the stubs after editing a .proto with `python -m protos.generate`;
tests/test_protos.py fails when the committed stubs are stale. Import as
`from protos import common_pb2, prefill_pb2_grpc`. This package imports nothing else of Baton's.
"""
