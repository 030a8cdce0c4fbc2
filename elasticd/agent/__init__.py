"""The per-node daemon: torch's elastic agent, our supervisor loop around it, and what it watches."""
