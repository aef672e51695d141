"""The agent client: the archive shipped to a host and the client that calls its verbs."""
