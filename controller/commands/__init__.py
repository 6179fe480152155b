"""What each verb decides, returned as dataclasses, never printed.

Verb modules (deploy, runs, environment, cache, snapshot, store, supervise, dashboard, discover, sessions) never
import each other: they share fanout (one call per container, in parallel), pins (what a container is to hold),
envprobe (its environment and lock), preflight (what a launch checks), reconcile (the registry brought in line
with the containers), launcher (starting and stopping runs), monitor (metrics and verdicts) and notify (sinks).
runbook binds a runbook's step kinds to the verbs. tests/test_layers.py keeps it so.
"""
