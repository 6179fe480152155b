"""Transports: a host over SSH, a container through pct, a container over SSH, this machine."""
