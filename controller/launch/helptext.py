"""What typer prints for `ctl --help` (written by scripts/gen_helptext.py; tests/test_cli_startup.py
keeps it equal to typer's own output)."""

TEXT = (
    'Usage: ctl [OPTIONS] COMMAND [ARGS]...\n'
    '\n'
    '  Operate GPU training runs in Proxmox VE LXC containers: deploy, launch,\n'
    '  follow, compare.\n'
    '\n'
    'Options:\n'
    '  -i, --inventory <str>  Inventory file (env CTL_INVENTORY, config\n'
    '                         `inventory`; default ./inventory.yaml).\n'
    '  --json / --text        Machine-readable output, or text (env CTL_OUTPUT,\n'
    '                         config `output`; default text).\n'
    '  --debug                Show tracebacks.\n'
    "  --version              Print ctl's version and the commit it was built from.\n"
    '  --install-completion   Install completion for the current shell.\n'
    '  --show-completion      Show completion for the current shell, to copy it or\n'
    '                         customize the installation.\n'
    '  --help                 Show this message and exit.\n'
    '\n'
    'Commands:\n'
    '  dashboard  Serve a local web page of the live runs, updated as they train.\n'
    '  deploy     Pin the payload, push only what changed, verify it inside...\n'
    "  doctor     Say why a container's GPUs do not work, and print the exact...\n"
    "  ping       Reach ctl's agent in each container as every command does,...\n"
    '  mark-good  Mark a run as known-good: the baseline of later runs (an...\n'
    "  status     Show the live runs (else each container's latest run),...\n"
    '  watch      Pull every few seconds until --until-step or --for is...\n'
    '  plot       Plot tok/s and loss by step of several runs, with the...\n'
    '  launch     Preflight, then start the run in a detached tmux session...\n'
    "  tail       Show the run's log; with -f follow it until the run ends...\n"
    '  runs       List runs from the registry (live ones are refreshed from...\n'
    '  show       Everything recorded about one run.\n'
    '  stop       SIGINT the training, wait, escalate, end its tmux session;...\n'
    "  attach     Attach to the run's tmux session interactively (ssh -t + pct...\n"
    '  diff       What changed between two runs: payload hashes, rendered...\n'
    "  export     Export the run's drafter for SGLang, vLLM or z-lab's dflash.\n"
    '  rollback   Shortcut for `ctl snapshot rollback`.\n'
    '  supervise  Watch every live run: verdict changes become events (`ctl...\n'
    '  events     What `ctl supervise` saw and did: verdict changes, restarts,...\n'
    '  config     The user config file: where it is, and the effective...\n'
    '  env        The training venv against its lock: probe, check, lock,...\n'
    '  cache      The torch.compile cache: status, save, restore, warm...\n'
    '  inventory  List hosts and containers of the inventory; `discover` reads...\n'
    "  metrics    Pull a run's metrics (only new log bytes travel) and export...\n"
    '  mux        Persistent host sessions (on by default, 60 idle seconds;...\n'
    '  runbook    Run a YAML runbook of ctl steps (deploy, env-check, launch,...\n'
    '  snapshot   Snapshots of a container (PVE API, or pct over SSH): create,...\n'
    '  store      The store of deployed file versions in each container:...\n'
)
