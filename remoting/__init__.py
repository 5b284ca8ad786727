"""What the servers and their clients share on the wire (RocketMQ's ``remoting`` module): how
every tmq server registers gRPC servicers (``servicers.py``), the NameServer's protocol
(``namesrv.proto``) and its client (``namesrv_client.py``), which brokers and tools use.

It sits beside ``offload`` and ``lakehouse`` in the layers and imports nothing of tmq's, so the
broker can talk to NameServers without importing the NameServer (decision 105).
"""
