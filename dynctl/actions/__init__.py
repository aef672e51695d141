"""What a view asks for in one call: a host's deploy/stop/bench actions, the demo hosts."""
