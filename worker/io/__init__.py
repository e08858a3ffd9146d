"""The worker's edge: the ROUTER socket's thread and the outbox it drains, the gateways it knows
and what their messages get, the channels it shares with the tick loop, the handshake, CURVE
keys and the IPC endpoint's lock."""
