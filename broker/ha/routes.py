"""Topic routes for replica groups: one broker per broker name, reached at every member.

The NameServers list each registration (the master as broker id 0, each slave under its id).
A client is given one ``Broker`` per broker name whose ``Endpoints`` hold the master's address
and every registered slave's: Apache's clients open one channel over all of them and use the
first that answers, and a member that is not the master forwards what needs it (broker/ha/
forward.py). A group whose master is not registered (an election is under way) is still routed,
to its slaves, which serve reads (decision 134). Groups without a controller register no topics
on their slaves, so their routes name the master alone, as before.
"""

from __future__ import annotations

from rocketmq.grpc_protocol import definition_pb2 as d

from broker.protocol import endpoints as address_endpoints
from broker.protocol import message_queue
from remoting import namesrv_pb2 as nspb


def group_queues(
    route: nspb.TopicRoute,
    topic: str,
    namespace: str,
    one_address: tuple[str, int] | None = None,
) -> list[d.MessageQueue]:
    """``one_address``: the client takes one address per broker (Apache's Node.js client joins
    an ``Endpoints``' addresses into a single gRPC target, ``host:p,host:q``, that no resolver
    takes): each group is named by that address when it is one of its members (the member
    that answers the query, which the client reached and which forwards to the master), else
    by its first registration alone."""
    by_name: dict[str, list[nspb.BrokerQueues]] = {}
    for b in route.brokers:
        by_name.setdefault(b.broker_name, []).append(b)
    out = []
    for name, members in sorted(by_name.items()):
        members.sort(key=lambda b: b.broker_id)
        primary = members[0]
        for q in range(primary.queues):
            mq = message_queue(
                topic,
                q,
                primary.perm,
                primary.message_type,
                name,
                primary.endpoint.host,
                primary.endpoint.port,
                namespace,
            )
            endpoints = mq.broker.endpoints
            addresses = {(m.endpoint.host, m.endpoint.port) for m in members}
            if one_address is not None:
                if one_address in addresses:
                    endpoints.CopyFrom(address_endpoints(*one_address))
            elif endpoints.scheme != d.DOMAIN_NAME:  # the client takes one DNS name only
                seen = {(primary.endpoint.host, primary.endpoint.port)}
                for other in members[1:]:
                    address = (other.endpoint.host, other.endpoint.port)
                    if address not in seen:
                        seen.add(address)
                        endpoints.addresses.add(host=address[0], port=address[1])
            out.append(mq)
    return out
