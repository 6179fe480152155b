"""The verbs as typer commands: each parses its options, calls one commands.* function and renders what it
returns (rich tables, or --json). app.py holds the app, the global options, the output helpers and the one
place a command's connection pool is built; names.py lists the names an argument takes (completion). Each
other module registers one verb group on the app when imported (launch/table.py says which)."""
