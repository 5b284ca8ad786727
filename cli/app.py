"""The ``tmq`` command line. One module per command group; this one wires them together."""

from __future__ import annotations

import logging
import sys

import typer

from cli import client, lakehouse, offload, retain, servers
from cli import store as store_commands
from cli import topic as topic_commands

app = typer.Typer(
    name="tmq",
    help="tmq: a RocketMQ-5-compatible broker with tiered storage to S3 and Delta export.",
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
app.add_typer(store_commands.app, name="store")
app.add_typer(lakehouse.app, name="lakehouse")


def main() -> None:
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    app()


if __name__ == "__main__":
    main()
