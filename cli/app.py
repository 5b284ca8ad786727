"""The ``tmq`` command line. One module per command group; this one wires them together.

Every failure reaches the operator as one line on stderr starting with ``error:`` and a non-zero
exit code: commands raise ``typer.Exit`` with their own message, and ``main`` turns whatever
escapes them (an RPC error, a refused connection, a bug) into such a line. Known secrets are
scrubbed from that line and from every log record (tiered/cold/credentials.py).
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from typing import Annotated

import grpc
import typer
from typer.completion import install_callback, show_callback

try:  # typer 0.2x parses with its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover (older typer: click itself)
    from click import exceptions as click_errors  # type: ignore[no-redef]

from cli import acl, client, cluster, lakehouse, offload, retain, servers, status
from cli import store as store_commands
from cli import topic as topic_commands
from tiered.cold.credentials import scrub_known, scrub_logs, secret_values

app = typer.Typer(
    name="tmq",
    help="tmq: a RocketMQ-5-compatible broker with tiered storage to S3 and Delta export.\n\n"
    "Example: tmq standalone, then in another shell: tmq status",
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # tracebacks with locals could print secrets
    # Typer's own completion options ignore the shell named (they detect the running one):
    # ``tmq --show-completion zsh`` printed bash. These take the shell as their value.
    add_completion=False,
)


class Shell(enum.StrEnum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"
    powershell = "powershell"
    pwsh = "pwsh"


@app.callback()
def _root(
    show_completion: Annotated[
        Shell | None,
        typer.Option(
            "--show-completion",
            metavar="SHELL",
            callback=show_callback,
            expose_value=False,
            is_eager=True,
            help="Print the completion script for SHELL (bash, zsh, fish, powershell).",
        ),
    ] = None,
    install_completion: Annotated[
        Shell | None,
        typer.Option(
            "--install-completion",
            metavar="SHELL",
            callback=install_callback,
            expose_value=False,
            is_eager=True,
            help="Install completion for SHELL.",
        ),
    ] = None,
) -> None:
    """tmq: a RocketMQ-5-compatible broker with tiered storage to S3 and Delta export."""


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
app.add_typer(cluster.app, name="cluster")
app.add_typer(acl.user_app, name="user")
app.add_typer(acl.acl_app, name="acl")


def _one_line(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        details = e.details() if hasattr(e, "details") else None
        text = f"{e.code().name}: {details}" if details else e.code().name
    else:
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return scrub_known(" ".join(text.split()))


def main() -> None:
    # TMQ_LOG_LEVEL=INFO adds the replication link's life (connections, streams, SyncStateSet).
    level = logging.getLevelNamesMapping().get(
        os.environ.get("TMQ_LOG_LEVEL", "").upper(), logging.WARNING
    )
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    scrub_logs(secret_values(env=os.environ))
    try:
        code = app(prog_name="tmq", standalone_mode=False)
    except click_errors.NoArgsIsHelpError as e:
        typer.echo(e.format_message())  # `tmq` or `tmq topic` alone: the help
        sys.exit(2)
    except click_errors.UsageError as e:
        # A typo (unknown command or option, a bad value): the one-line form, not a box.
        where = e.ctx.command_path if e.ctx is not None else "tmq"
        message = " ".join(e.format_message().split())
        typer.echo(f"error: {scrub_known(message)} (see '{where} --help')", err=True)
        sys.exit(e.exit_code)
    except typer.Abort:
        typer.echo("error: interrupted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        sys.exit(130)
    except Exception as e:
        # Not a command's own failure (those exit with their message): say what it was in
        # one line; the traceback goes to the debug log only.
        logging.getLogger("tmq").debug("unhandled", exc_info=True)
        typer.echo(f"error: {_one_line(e)}", err=True)
        sys.exit(1)
    if isinstance(code, int) and code != 0:
        sys.exit(code)


if __name__ == "__main__":
    main()
