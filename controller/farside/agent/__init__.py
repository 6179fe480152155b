"""ctl's agent: runs INSIDE a container (stdlib only, Python >= 3.8), one invocation per operation.

The controller never imports it. It sends its source (these parts, joined by controller/farside/__init__.py)
over the stdin of one exec (`python3 -c BOOT N verb ...`: BOOT reads N bytes of source from stdin and runs
them; the rest of stdin is the verb's input), so a whole operation costs one `pct exec`, whatever the number of files.

Verbs (each prints one JSON document on stdout; exit 0 when "ok" is true):
  hashes   ROOT [--follow=JSON] PATH...  sha256/size/mode of each path (null when missing)
  sync     ROOT STORE DEPLOY_ID    plan + apply in one exec: stdin header line (pinned files, "follow")
                                   -> stdout line (what it has, what it needs) -> stdin "apply" + tar
  apply    ROOT STORE DEPLOY_ID    stdin: a tar of manifest.json + file bodies. Every file is written
                                   to a temporary name beside its destination and verified; the old
                                   and new versions are kept in STORE/objects (content-addressed, with
                                   the file's mode); only when all of that succeeded is each file renamed
                                   into place (atomic per file) and read back. A failure before the
                                   renames leaves every destination untouched; one during them puts the
                                   renamed files back from the store ("partial" names what could not be).
                                   No temporary file remains. Paths are walked without following
                                   symlinks (code "symlink"), except under the "follow" prefixes.
  storelist JSON-ARGS              the store's objects (bytes, mode) and its deploy records
  storeprune JSON-ARGS             delete the named objects (ctl store prune decides which)
  probe    JSON-ARGS               launch preflight facts in one round trip (files, tmux, log, disk,
                                   GPUs, logs of the run series)
  launch   JSON-ARGS               write the run record beside the log (never over one) and start the
                                   detached tmux session
  runstate JSON-ARGS               exit status / liveness / log size of runs
  stop     JSON-ARGS               SIGINT the run's process group, escalate, end its session
  tailinfo JSON-ARGS               log size and last N lines
  logread  JSON-ARGS               a JSON header line, then raw log bytes from an offset (+ file hashes)
  poll     JSON-ARGS               runstate + logread of every run of the container in one call: a JSON
                                   header line, then the runs' log bytes back to back
  cachestat JSON-ARGS              compile cache size, entries (fxgraph/aotautograd/triton), marker; saved caches
  cachemark JSON-ARGS              write the cache's ctl-cache.json marker (torch build that filled it)
  cachesave JSON-ARGS              tar.gz of the cache + sidecar JSON (sha256, torch build); never overwrites
  cacherestore JSON-ARGS           verify sha256, unpack beside, move the current cache aside (kept), swap in
  envfacts JSON-ARGS               venv symlink/dir, where uv is, which paths are taken (ctl env sync)
  writefile JSON-ARGS              stdin -> a new file (refuses to replace one)
  ckptscan JSON-ARGS               newest complete checkpoint (manifest present, sha256s match) under given dirs
  packdir  JSON-ARGS               a checkpoint directory as a tar stream in base64 lines (between JSON lines)
  unpackdir JSON-ARGS              stdin (a tar stream) -> a new checkpoint directory, verified by its manifest
  hello    JSON-ARGS               who answers: pid, python, whether a staying agent (`ctl ping`)
  serve                            stay: answer requests for the verbs above, one at a time, until stdin ends
                                   (started by ctl's host relay, controller/farside/relay/; see serve())
"""
