"""The ``tmq`` command line. One module per command group; this one wires them together.

Every failure reaches the operator as one line on stderr starting with ``error:`` and a non-zero
exit code: commands raise ``typer.Exit`` with their own message, and ``main`` turns whatever
escapes them (an RPC error, a refused connection, a bug) into such a line. Known secrets are
scrubbed from that line and from every log record (tiered/cold/credentials.py).
"""

from __future__ import annotations

import logging
import os
import sys

import grpc
import typer

from cli import client, lakehouse, offload, retain, servers, status
from cli import store as store_commands
from cli import topic as topic_commands
from tiered.cold.credentials import scrub_known, scrub_logs, secret_values

app = typer.Typer(
    name="tmq",
    help="tmq: a RocketMQ-5-compatible broker with tiered storage to S3 and Delta export.\n\n"
    "Example: tmq standalone, then in another shell: tmq status",
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # tracebacks with locals could print secrets
    add_completion=True,
)
app.command("standalone")(servers.standalone)
app.add_typer(servers.namesrv_app, name="namesrv")
app.add_typer(servers.broker_app, name="broker")
app.add_typer(topic_commands.app, name="topic")
app.command("produce")(client.produce)
app.command("consume")(client.consume)
app.command("replay")(client.replay)
app.command("query")(client.query)
app.command("retain")(retain.retain)
app.command("offload")(offload.offload)
app.command("verify")(offload.verify)
app.command("status")(status.status)
app.add_typer(store_commands.app, name="store")
app.add_typer(lakehouse.app, name="lakehouse")


def _one_line(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        details = e.details() if hasattr(e, "details") else None
        text = f"{e.code().name}: {details}" if details else e.code().name
    else:
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return scrub_known(" ".join(text.split()))


def main() -> None:
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    scrub_logs(secret_values(env=os.environ))
    try:
        app(prog_name="tmq")
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        sys.exit(130)
    except Exception as e:
        # Not a command's own failure (those exit with their message): say what it was in
        # one line; the traceback goes to the debug log only.
        logging.getLogger("tmq").debug("unhandled", exc_info=True)
        typer.echo(f"error: {_one_line(e)}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
