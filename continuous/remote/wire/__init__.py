"""What both sides of the swarm share: the message format and errors, and checkpoint loading."""
