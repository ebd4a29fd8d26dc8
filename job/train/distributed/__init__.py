"""The torchrun group's mechanics: process group, liveness, transport, the lock protocol, client, server, state."""
