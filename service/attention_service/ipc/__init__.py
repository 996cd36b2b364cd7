"""Process-group plumbing."""
