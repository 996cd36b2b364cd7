"""Deployment tests: Docker and compose files, monitoring config, dashboard, load test."""
