"""Regenerate the Python modules of tmq's own .proto files (remoting/, broker/); run from anywhere.

Apache's MessagingService stubs are not generated here: they come from rocketmq-python-client.
"""

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = [
    ROOT / "remoting" / "namesrv.proto",
    ROOT / "broker" / "admin.proto",
    ROOT / "broker" / "acl.proto",
    ROOT / "broker" / "ha" / "relay.proto",
]

if __name__ == "__main__":
    for proto in PROTOS:
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
