"""Metrics commands (`ctl metrics ...`, `ctl status`, `ctl watch`, `ctl plot`): registered on the main app."""

from __future__ import annotations
