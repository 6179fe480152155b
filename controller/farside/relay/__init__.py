"""ctl's host relay: runs ON a Proxmox host (stdlib only, Python >= 3.6), one per host and command.

The controller never imports it. It sends its source (these parts, joined by controller/farside/__init__.py)
over the stdin of ONE SSH exec
(`python3 -I -S -c BOOT N`, like the agent), and the relay then starts, for each container of that
host, the exact argv ctl would otherwise have sent through its own exec (`pct exec VMID -- python3
... agent ...`), concurrently, with no shell. Their stdin, stdout, stderr and exit status travel as
frames over the relay's own stdin/stdout, so every container's conversation with its agent is the
same as over a direct exec, while the host's login shell and the SSH channel are paid once.

Frame: 7-byte header (kind: 1 byte, stream id: 2 bytes, length: 4 bytes, big-endian), then the data.
  controller -> relay  S start (data: JSON argv)   I stdin data   C close that stdin
                       T (stream 0) what staying agents it keeps (answered by T, JSON {"agents": [...]})
                       A start an agent request (data: JSON {"argv", "at", "n", "retry", "sha"}): like S for
                         the argv `PREFIX... python3 -I -S -c BOOT N VERB ARGS` (argv[at] is VERB), whose stdin
                         starts with the agent's n-byte source; answered by a staying agent (below). With n 0,
                         the source is the one of that sha256 the relay kept from an earlier request; when it
                         has none it answers U, then X, and ctl sends the request again with its source
                       K abandon: close its stdin and stop reading its output (its next write fails, as
                         when an SSH channel closes under a command); its X frame still comes
  relay -> controller  H hello (stream 0, JSON)    O stdout data  E stderr data  X exit status (ASCII)
                       U (before X) that agent request's source is not kept here
A child that cannot be started answers E (the reason) and X 127, as a shell would. A stream id is
forgotten before its X frame goes out, so the controller may reuse it as soon as it has read that X (ids
are 16 bits: a long-lived session wraps around them). End of the
relay's stdin (ctl is done, or the connection dropped) closes every child's stdin; the relay waits
for the children (an agent that sees its stdin end leaves every old file whole) and exits.

Staying agents. An A request runs in a process that stays: `PREFIX... python3 -I -S -c BOOT N serve`
(the agent's serve()), one per container and agent source (its sha256), kept while the relay lives, so a
request costs neither `pct exec`, nor a python3 start, nor a compile of the agent. The answer is the O, E
and X frames the exec would have given. When PREFIX is Proxmox's own `pct exec VMID --`, the staying agent
starts the way pct would start it once it found the container running (pve-container's pct.pm: `lxc-attach
-n VMID --keep-env -- ...` with PATH reset and SSL_CERT_FILE/SSL_CERT_DIR dropped), without pct itself: pct
is a Perl program that loads PVE's modules, several hundred milliseconds a start on a real host, paid once
per container and session. When that attach does not say hello (a stopped container, a host whose LXC is not
at its default lxcpath), the agent starts through pct as before, so pct's checks and refusals stay pct's.
The relay falls back to the exec itself when a staying agent cannot
start (pct's refusal then reaches ctl as it always did), when its input is large (that exec starts as soon as
the input passes RESIDENT_MAX_INPUT, so the relay never holds more), when RESIDENT_PER_KEY of them are busy or
the relay keeps as many as its descriptors allow, and, for a request marked "retry" (a verb that only reads),
when one ended before answering. Such an exec, and any S exec in a container (`pct exec VMID -- ...`), attaches
directly while a staying agent of that container that came in through lxc-attach is alive (the container is
running: pct would only find that again). A K ends the staying agent answering that stream, even one that stopped
reading (its writes never block).
"""

