"""The ``tmq`` command line (cli/app.py wires the command groups)."""

import os

# Apache's Python client trusts gRPC's default roots only (GRPC_DEFAULT_SSL_ROOTS_FILE_PATH,
# read by gRPC once): the CA the CLI is told to trust for tmq's TLS ports (TMQ_TLS_CA_FILE,
# docs/security.md) replaces them, before any module of the CLI imports grpc.
if os.environ.get("TMQ_TLS_CA_FILE"):
    os.environ["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"] = os.environ["TMQ_TLS_CA_FILE"]
