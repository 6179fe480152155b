"""Pure logic, no I/O: metrics parsing and verdicts, the env lock format, rendering, run diffs, runbooks, run
name series, discovery's reading of the Proxmox API, redaction and the terminal cleaner. Property-tested."""
