"""What each broker RPC touches, who may call it, and the ACL service (``tmq user``, ``tmq acl``).

The resources of a MessagingService request follow Apache's proxy
(``DefaultAuthorizationContextBuilder``): a send needs PUB on its topic; a receive, an ack, a
pull or an offset needs SUB on the group and on the topic; a route lookup needs PUB or SUB on the
topic; a consumer's heartbeat SUB on its group; a Telemetry stream's settings PUB on each topic
it publishes to, SUB on its group and the topics it subscribes to. tmq also checks every message
of a batch (the proxy checks the first) and the offset RPCs the proxy leaves out. Admins pass
everything; the admin and ACL services are for admins only.
"""

from __future__ import annotations

from typing import Any

import grpc
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol.service_pb2 import SendMessageRequest

from broker import acl_pb2 as pb
from broker import acl_pb2_grpc as pb_grpc
from broker.acl import PUB, SUB, AclError, AclStore, Grant
from broker.protocol import scan_send_request
from remoting.auth import Principal

MESSAGING = "/apache.rocketmq.v2.MessagingService/"
_CONSUMERS = {value for name, value in d.ClientType.items() if name.endswith("CONSUMER")}

Need = tuple[str, str, tuple[str, ...]]  # (kind, name, any of these actions)


def _sub(group: str, topic: str) -> list[Need]:
    return [("group", group, (SUB,)), ("topic", topic, (SUB,))]


def resources(method: str, r: Any) -> list[Need] | None:
    """What a MessagingService request touches; None: a method only admins may call."""
    if method == "QueryRoute":
        return [("topic", r.topic.name, (PUB, SUB))]
    if method == "Heartbeat":
        return [("group", r.group.name, (SUB,))] if r.client_type in _CONSUMERS else []
    if method == "SendMessage":
        return [("topic", t, (PUB,)) for t in sorted({m.topic.name for m in r.messages})]
    if method in ("EndTransaction", "RecallMessage"):
        return [("topic", r.topic.name, (PUB,))]
    if method in (
        "QueryAssignment",
        "AckMessage",
        "ForwardMessageToDeadLetterQueue",
        "ChangeInvisibleDuration",
    ):
        return _sub(r.group.name, r.topic.name)
    if method in ("ReceiveMessage", "PullMessage", "UpdateOffset", "GetOffset"):
        return _sub(r.group.name, r.message_queue.topic.name)
    if method == "QueryOffset":
        return [("topic", r.message_queue.topic.name, (SUB,))]
    if method == "NotifyClientTermination":
        return [("group", r.group.name, (SUB,))] if r.group.name else []
    if method == "Telemetry":
        if not r.HasField("settings"):
            return []  # results of commands the broker sent
        s = r.settings
        needs: list[Need] = [("topic", t.name, (PUB,)) for t in s.publishing.topics]
        if s.HasField("subscription"):
            needs.append(("group", s.subscription.group.name, (SUB,)))
            needs += [("topic", e.topic.name, (SUB,)) for e in s.subscription.subscriptions]
        return needs
    return None


def send_resources(raw: bytes) -> list[Need] | None:
    """What a SendMessage request touches, from its bytes (SendMessage takes them, decision
    310): the topic read by the native walker when it takes the request, else by protobuf;
    None when they do not decode."""
    scanned = scan_send_request(raw)
    if scanned is not None:
        return [("topic", scanned.topic, (PUB,))]
    try:
        request = SendMessageRequest.FromString(raw)
    except Exception:  # DecodeError, or anything a hostile payload provokes
        return None
    return resources("SendMessage", request)


class BrokerPolicy:
    """The broker's ``Authorize`` (remoting/auth.py), reading ``acl`` on every call."""

    def __init__(self, acl: AclStore) -> None:
        self.acl = acl

    def __call__(self, principal: Principal, method: str, request: Any) -> str | None:
        if principal.admin:
            return None
        if not method.startswith(MESSAGING):
            return f"{method} needs an admin user"
        name = method[len(MESSAGING) :]
        if isinstance(request, bytes):
            needs = send_resources(request) if name == "SendMessage" else None
            if needs is None:
                return "malformed request"
        else:
            needs = resources(name, request)
        if needs is None:
            return f"{name} needs an admin user"
        for kind, resource, actions in needs:
            if not self.acl.allows(principal.name, kind, resource, actions):
                return f"user {principal.name} has no {' or '.join(actions)} on {kind} {resource}"
        return None


class AclServicer(pb_grpc.AclServicer):
    """``tmq.acl.v1.Acl``: users and grants. Admins only (the interceptor sees to it)."""

    def __init__(self, acl: AclStore) -> None:
        self.acl = acl

    def CreateUser(
        self, request: pb.CreateUserRequest, context: grpc.ServicerContext
    ) -> pb.CreateUserResponse:
        try:
            secret = self.acl.create_user(
                request.name, request.admin, request.secret_key, request.replace
            )
        except AclError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.CreateUserResponse(
            user=pb.User(name=request.name, admin=request.admin), secret_key=secret
        )

    def DeleteUser(
        self, request: pb.DeleteUserRequest, context: grpc.ServicerContext
    ) -> pb.DeleteUserResponse:
        try:
            removed = self.acl.delete_user(request.name)
        except AclError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return pb.DeleteUserResponse(grants_removed=removed)

    def ListUsers(
        self, request: pb.ListUsersRequest, context: grpc.ServicerContext
    ) -> pb.ListUsersResponse:
        return pb.ListUsersResponse(
            users=[pb.User(name=n, admin=admin) for n, admin in self.acl.users()]
        )

    def Grant(self, request: pb.GrantRequest, context: grpc.ServicerContext) -> pb.GrantResponse:
        g = request.grant
        try:
            self.acl.grant(Grant.of(g.user, g.resource, list(g.actions), g.deny))
        except AclError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.GrantResponse()

    def Revoke(self, request: pb.RevokeRequest, context: grpc.ServicerContext) -> pb.RevokeResponse:
        try:
            removed = self.acl.revoke(request.user, request.resource)
        except AclError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.RevokeResponse(removed=removed)

    def ListGrants(
        self, request: pb.ListGrantsRequest, context: grpc.ServicerContext
    ) -> pb.ListGrantsResponse:
        return pb.ListGrantsResponse(
            grants=[
                pb.Grant(user=g.user, resource=g.resource, actions=list(g.actions), deny=g.deny)
                for g in self.acl.grants(request.user)
            ]
        )
