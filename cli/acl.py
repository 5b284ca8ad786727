"""``tmq user …`` and ``tmq acl …``: users with access keys, and what each may do (ACL 2.0).

Sent to every master broker (slaves receive them by replication), signed with the environment's
admin key like every other command (``TMQ_ADMIN_ACCESS_KEY`` / ``TMQ_ADMIN_SECRET_KEY``). A new
user's secret is generated here once, so every broker holds the same one, and printed once.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated

import typer

from broker import acl_pb2 as pb
from broker import acl_pb2_grpc as pb_grpc
from cli.topic import JsonOption, NamesrvOption, ask_namesrv, call, fail, security

user_app = typer.Typer(
    help="Users (access key and secret key) of an auth-enabled cluster.\n\n"
    "Example: tmq user create billing-app",
    no_args_is_help=True,
)
acl_app = typer.Typer(
    help="What each user may do: PUB/SUB on topics and groups.\n\n"
    "Example: tmq acl grant billing-app --resource topic:orders --actions SUB",
    no_args_is_help=True,
)


def _masters(namesrv: str) -> list[tuple[str, pb_grpc.AclStub]]:
    info = ask_namesrv(namesrv, lambda c: c.cluster_info())
    found = [
        (
            b.broker.broker_name,
            pb_grpc.AclStub(
                security().channel(f"{b.broker.endpoint.host}:{b.broker.endpoint.port}")
            ),
        )
        for b in info.brokers
        if b.broker.broker_id == 0
    ]
    if not found:
        raise fail("no live master broker is registered")
    return found


@user_app.command("create")
def create_user(
    name: str,
    namesrv: NamesrvOption = "127.0.0.1:9876",
    admin: Annotated[bool, typer.Option(help="Every permission, admin commands included.")] = False,
    rotate: Annotated[
        bool, typer.Option(help="The user exists: give it a new secret (the old one stops).")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Create a user; its secret key is printed once, here, and never again.

    Example: tmq user create billing-app
    """
    secret = secrets.token_urlsafe(24)
    request = pb.CreateUserRequest(name=name, admin=admin, secret_key=secret, replace=rotate)
    done = []
    for broker_name, stub in _masters(namesrv):
        call(f"broker {broker_name}", stub.CreateUser, request)
        done.append(broker_name)
    if as_json:
        typer.echo(json.dumps({"user": name, "admin": admin, "secret_key": secret}))
    else:
        typer.echo(f"access key: {name}\nsecret key: {secret}")
        typer.echo(
            f"user {name} {'rotated' if rotate else 'created'} on {', '.join(done)}; the secret "
            "key is shown only now",
            err=True,
        )


@user_app.command("list")
def list_users(namesrv: NamesrvOption = "127.0.0.1:9876", as_json: JsonOption = False) -> None:
    """List users (never their secrets).

    Example: tmq user list --json
    """
    for broker_name, stub in _masters(namesrv):
        reply = call(f"broker {broker_name}", stub.ListUsers, pb.ListUsersRequest())
        for u in reply.users:
            if as_json:
                typer.echo(json.dumps({"broker": broker_name, "user": u.name, "admin": u.admin}))
            else:
                typer.echo(f"{broker_name} {u.name}{' (admin)' if u.admin else ''}")


@user_app.command("delete")
def delete_user(name: str, namesrv: NamesrvOption = "127.0.0.1:9876") -> None:
    """Delete a user and its grants; its signed requests are refused from now on.

    Example: tmq user delete billing-app
    """
    for broker_name, stub in _masters(namesrv):
        reply = call(f"broker {broker_name}", stub.DeleteUser, pb.DeleteUserRequest(name=name))
        typer.echo(f"{broker_name}: deleted {name} and {reply.grants_removed} grant(s)", err=True)


@acl_app.command("grant")
def grant(
    user: str,
    resource: Annotated[
        str,
        typer.Option(help="topic:NAME, topic:PREFIX*, topic:*, group:NAME, group:PREFIX*, group:*"),
    ],
    actions: Annotated[str, typer.Option(help="PUB, SUB or ALL, comma-separated.")],
    deny: Annotated[bool, typer.Option(help="Deny instead of allow.")] = False,
    namesrv: NamesrvOption = "127.0.0.1:9876",
) -> None:
    """Allow (or --deny) USER the actions on a resource; replaces USER's grant on it.

    Example: tmq acl grant billing-app --resource topic:orders --actions PUB,SUB
    """
    g = pb.Grant(user=user, resource=resource, actions=actions.split(","), deny=deny)
    for broker_name, stub in _masters(namesrv):
        call(f"broker {broker_name}", stub.Grant, pb.GrantRequest(grant=g))
    typer.echo(f"{'denied' if deny else 'granted'} {actions} on {resource} to {user}", err=True)


@acl_app.command("revoke")
def revoke(
    user: str,
    resource: Annotated[str, typer.Option(help="The grant's resource (default: all).")] = "",
    namesrv: NamesrvOption = "127.0.0.1:9876",
) -> None:
    """Remove USER's grant on a resource (or all); takes effect on the next request.

    Example: tmq acl revoke billing-app --resource topic:orders
    """
    for broker_name, stub in _masters(namesrv):
        reply = call(
            f"broker {broker_name}", stub.Revoke, pb.RevokeRequest(user=user, resource=resource)
        )
        typer.echo(f"{broker_name}: revoked {reply.removed} grant(s) of {user}", err=True)


@acl_app.command("list")
def list_grants(
    user: Annotated[str, typer.Argument(help="Only this user's grants.")] = "",
    namesrv: NamesrvOption = "127.0.0.1:9876",
    as_json: JsonOption = False,
) -> None:
    """List grants.

    Example: tmq acl list billing-app
    """
    for broker_name, stub in _masters(namesrv):
        reply = call(f"broker {broker_name}", stub.ListGrants, pb.ListGrantsRequest(user=user))
        for g in reply.grants:
            row = {
                "broker": broker_name,
                "user": g.user,
                "resource": g.resource,
                "actions": list(g.actions),
                "decision": "DENY" if g.deny else "ALLOW",
            }
            if as_json:
                typer.echo(json.dumps(row))
            else:
                typer.echo(
                    f"{broker_name} {g.user} {row['decision']} {','.join(g.actions)} {g.resource}"
                )
