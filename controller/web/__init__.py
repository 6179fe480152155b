"""The web presentation layer: `ctl dashboard`'s HTTP server and its page (static files shipped in the package).

Like cli/, it renders what commands/ decide; it never reaches a host or a container itself.
"""
