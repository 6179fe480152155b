"""ctl: a job controller for GPU training runs inside Proxmox VE LXC containers."""

__version__ = "0.1.0"
