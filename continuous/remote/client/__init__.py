"""The client side of the swarm: sessions over chains of servers, routing, the HF bridge, the head's batcher."""
