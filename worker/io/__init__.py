"""The worker's edge: the ROUTER socket's thread, the channels it shares with the tick loop, the
outbox, the gateways it knows, the handshake, CURVE keys and the IPC endpoint's lock."""
