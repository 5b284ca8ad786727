"""Regenerate namesrv_pb2.py / namesrv_pb2_grpc.py from namesrv.proto (run from anywhere)."""

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            str(ROOT / "namesrv" / "namesrv.proto"),
        ]
    )
    raise SystemExit(code)
