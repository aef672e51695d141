"""What reads a host's live numbers, UI-free: the snapshot, the feed that polls it, the server status."""
