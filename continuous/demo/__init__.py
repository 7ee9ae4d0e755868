"""The demo (``python -m continuous.demo``) and the local swarm it starts (:mod:`.swarm`)."""
